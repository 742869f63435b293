"""Other toolkits' formats: export to CTranslate2 and Hugging Face (export.py), import of OPUS-MT Marian models
(convert.py), and the weight map the two share (marian.py)."""
