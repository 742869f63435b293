"""The HTTP server: LibreTranslate's API over the Translator, with dynamic batching (server.py, batcher.py),
request bodies (bodies.py), translated files (documents.py), source language detection (languages.py) and
the connection guards in front of it (guards.py). `python -m seq2seq.serve` runs it; the `[serve]` extra
installs what it needs."""
