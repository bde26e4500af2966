"""The embedding tests use `minilm_dir` (tests/conftest.py: all-MiniLM-L6-v2 from its
wheel) and the offline demo models as decoder embedders / rerankers."""
