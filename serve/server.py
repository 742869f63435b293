"""The HTTP translation server, as a script: `python serve/server.py --checkpoint ...` is
`python -m seq2seq.serve --checkpoint ...` (the server itself is seq2seq/serve/server.py, installed with
the package)."""

from seq2seq.serve.server import run

if __name__ == "__main__":
    run()
