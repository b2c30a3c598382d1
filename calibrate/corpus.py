"""The calibration corpus: the shipped text or the user's file/folder, tokenized with the
checkpoint's own tokenizer into equal-length sequences."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from ..calibration_settings import CalibrationError
from ..content_hash import corpus_hash

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".html")


def default_corpus_path() -> Path:
    return Path(str(resources.files("flashqla_tune.calibrate") / "data" / "corpus.txt"))


def read_corpus(source: str | Path | None) -> list[tuple[str, str]]:
    """(name, text) pairs: one file, or every text file under a folder in sorted order."""
    path = Path(source) if source is not None else default_corpus_path()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise CalibrationError(f"corpus folder {path} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    elif path.is_file():
        files = [path]
    elif path.exists():
        raise CalibrationError(f"corpus {path} is not a regular file or a folder (a device, pipe or socket): "
                               f"give a text file or a folder of text files")
    else:
        raise CalibrationError(f"corpus {path} does not exist")
    texts = []
    for f in files:
        text = decode_text(f, path.is_dir())
        if text is not None:
            texts.append((str(f.relative_to(path) if path.is_dir() else f.name), text))
    if not any(t.strip() for _, t in texts):
        raise CalibrationError(f"corpus {path} is empty")
    return texts


class CorpusWarning(UserWarning):
    """A corpus file was read, but not as clean UTF-8 text."""


# A file whose bytes are this share (or more) undecodable as UTF-8 is binary data, not text in
# another encoding (Latin-1 prose has a few percent, up to some ten, of non-ASCII bytes).
BINARY_UNDECODABLE_SHARE = 0.3


def decode_text(file: Path, in_folder: bool) -> str | None:
    """file's text. A binary file (NUL bytes, or mostly undecodable) is refused, or skipped with a
    warning inside a folder (None); text that is not UTF-8 is decoded with replacement characters,
    with a warning naming the file."""
    data = file.read_bytes()
    if b"\0" not in data:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            pass
    text = data.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - data.decode("utf-8", errors="ignore").count("\ufffd")
    if b"\0" in data or bad >= BINARY_UNDECODABLE_SHARE * max(len(text), 1):
        why = "holds NUL bytes" if b"\0" in data else f"has {bad} undecodable bytes in {len(data)}"
        if not in_folder:
            raise CalibrationError(f"corpus {file} {why}: a binary file, not text; give a text file")
        warnings.warn(f"corpus file {file} {why}: a binary file, skipped", CorpusWarning, stacklevel=3)
        return None
    warnings.warn(f"corpus file {file} is not UTF-8 text ({bad} undecodable bytes, read as U+FFFD): "
                  f"convert it to UTF-8 for a faithful calibration", CorpusWarning, stacklevel=3)
    return text


def load_tokenizer(checkpoint: str | Path):
    root = Path(checkpoint)
    if not any((root / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json",
                                              "tokenizer.model")):
        raise CalibrationError(f"checkpoint {root} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(root))
    except Exception as exc:  # transformers raises several types here
        raise CalibrationError(f"cannot load the tokenizer of {root}: {exc}") from exc


@dataclass(frozen=True)
class TokenizedCorpus:
    input_ids: torch.Tensor      # [num_sequences, seq_len] int64
    name: str
    sha256: str
    num_text_tokens: int

    def describe(self) -> dict:
        return {"name": self.name, "sha256": self.sha256, "num_sequences": int(self.input_ids.shape[0]),
                "seq_len": int(self.input_ids.shape[1]), "num_tokens": int(self.input_ids.numel()),
                "num_text_tokens": self.num_text_tokens}


def tokenize_corpus(texts: list[tuple[str, str]], tokenizer, seq_len: int, max_sequences: int | None,
                    name: str) -> TokenizedCorpus:
    """Concatenate the documents (separated by EOS when the tokenizer has one) and cut the stream
    into sequences of seq_len tokens; a short tail is dropped."""
    if seq_len < 1:
        raise CalibrationError(f"sequence length must be >= 1, got {seq_len}")
    stream: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    for _, text in texts:
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            stream.append(int(eos))
    n = len(stream) // seq_len
    if max_sequences is not None:
        n = min(n, max_sequences)
    if n == 0:
        raise CalibrationError(f"corpus {name} has {len(stream)} tokens, fewer than one sequence of {seq_len}")
    ids = torch.tensor(stream[: n * seq_len], dtype=torch.int64).view(n, seq_len)
    return TokenizedCorpus(input_ids=ids, name=name, sha256=corpus_hash(texts), num_text_tokens=len(stream))
