"""seq2seq: machine translation with an encoder-decoder Transformer."""
