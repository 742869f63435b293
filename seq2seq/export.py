"""`python -m seq2seq.export`: the face of seq2seq/interop/export.py."""

from seq2seq.interop.export import main

if __name__ == "__main__":
    main()
