"""`python -m seq2seq.serve --checkpoint ...`: the HTTP server (seq2seq/serve/server.py)."""

from seq2seq.serve.server import run

run()
