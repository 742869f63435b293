"""Text in and out of the model: the joint sentencepiece tokenizer (tokenizer.py), sentences (sentences.py), HTML as
browsers read it (markup.py, placement.py), subtitles (subtitles.py) and glossaries (glossary.py)."""
