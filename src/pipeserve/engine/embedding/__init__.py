"""Embedding and reranking models: an encoder (BERT-style, written here in MLX) or a
decoder (an mlx-lm model's hidden states) behind one engine thread that batches every
waiting input of every request (docs/embeddings.md). The request's chain around the
engine (input, tokenize, encode, pool, normalize) is stages/embedding/, declared in
pipelines/embedding.yaml and pipelines/rerank.yaml.

    spec.py      pooling, normalisation, dimensions, length: the folder's own
                 sentence-transformers files, then the YAML's overrides
    bert.py      the BERT / XLM-RoBERTa encoder in MLX (and a cross-encoder head)
    decoder.py   an mlx-lm decoder as embedder or yes/no reranker
    backbone.py  which of the two a folder is, loaded behind one interface
    inputs.py    text and token arrays -> token ids (limits, `truncate`)
    jobs.py      what a request submits and what it gets back
    mailbox.py   handing results from the engine thread to the waiting greenlet
    batches.py   the waiting sequences, grouped into padded batches by length
    engine.py    the engine thread: admission (429), batching, cancellation, stats
    ticket.py    the request's side of a job: wait, cancel
    yielding.py  giving way to chat decoding in the same server
    runtime.py   a model entry of kind embedding / rerank -> its ModelRuntime
"""
