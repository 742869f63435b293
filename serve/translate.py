"""Interactive translation, as a script: `python serve/translate.py --checkpoint ...` is
`python -m seq2seq.interactive --checkpoint ...` (seq2seq/interactive.py, installed with the package)."""

from seq2seq.interactive import run

if __name__ == "__main__":
    run()
