"""llama.cpp's server routes (`api: llama-cpp`, conventionally on `/`), in the layout
every protocol package shares (docs/architecture.md "Protocols"): schema.py (request
models), decode.py (bodies -> requests), encode.py (events -> llama.cpp's completion
objects), fold.py (objects -> the non-streaming body), protocol.py (the registered
WireProtocol: `/infill`, `/tokenize`, `/detokenize`). Importing this package registers
nothing."""
