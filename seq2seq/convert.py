"""`python -m seq2seq.convert`: the face of seq2seq/interop/convert.py."""

from seq2seq.interop.convert import main

if __name__ == "__main__":
    main()
