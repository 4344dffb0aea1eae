"""Text data: an embedded corpus, one-time tokenization with litdata (bytes, or a local Hugging Face tokenizer's
ids), ``prepare`` (``python -m lightning_async_pp.data.prepare``) and ``TextDataModule``."""
from lightning_async_pp.data.corpus import decode, encode, split_corpus, stdlib_files, text_files
from lightning_async_pp.data.datamodule import TextDataModule

__all__ = ["TextDataModule", "decode", "encode", "split_corpus", "stdlib_files", "text_files"]
