"""Data: TFDS array_record sources, tokenizers, Grain pipelines, BERT pretraining examples.

    from tfm.data import pipeline, sources, synthetic, tokenizers
    synthetic.prepare_translation(data_dir)                  # local En→De corpus as TFDS
    train = sources.load("synthetic_translate", "train", data_dir=data_dir)
    tok = tokenizers.train_sentencepiece(sources.texts(train, ("en", "de")), vocab_size=256)
    batches = pipeline.seq2seq_dataset(train, tok, batch_size=32, max_length=64)

Modules: `synthetic` (offline corpora), `sources` (wmt14, lm1b, wikipedia, bookcorpus, glue,
synthetic via `tfds.data_source`), `tokenizers` (SentencePiece, WordPiece), `pipeline`
(LM and seq2seq batches with packing and host sharding), `reading` (how they read records: in
blocks, optionally in worker processes), `pretraining` (BERT MLM+NSP),
`documents` (corpora read lazily in chunks: TFDS, text directories) and `streaming` (BERT and
RoBERTa batches streamed from them per host, checkpointable, in bounded memory).
"""
