"""Request inputs -> token sequences, within the model's limits.

Texts are tokenized with the folder's own tokenizer.json (its post-processor adds the
special tokens the model was trained with: [CLS] ... [SEP] for BERT). Token arrays are
taken as they are, each id checked against the vocabulary. An input longer than the
model's `max_length` is cut there only when the request says `truncate`; otherwise it
is a 400 that names the input and the limit.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

from tokenizers import Tokenizer

from pipeserve.engine.embedding.jobs import Sequence
from pipeserve.errors import ApiError, invalid


class InputTokenizer:
    def __init__(self, model_dir: Path, max_length: int, vocab_size: int) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self.plain = Tokenizer.from_file(str(path))
        self.plain.no_truncation()
        self.plain.no_padding()
        self.cutting = Tokenizer.from_file(str(path))
        self.cutting.no_padding()
        self.cutting.enable_truncation(max_length)
        self.max_length = max_length
        self.vocab_size = vocab_size

    def texts(
        self, texts: Seq[str], field: str, truncate: bool, single: bool = False
    ) -> list[Sequence]:
        """One sequence per text (a batch call: the tokenizer runs in parallel)."""
        for i, text in enumerate(texts):
            if not text:
                where = _at(field, i, single)
                raise invalid(f"{where}: an input must not be empty", where)
        encodings = (self.cutting if truncate else self.plain).encode_batch(list(texts))
        out = [Sequence(list(e.ids), list(e.type_ids)) for e in encodings]
        for i, seq in enumerate(out):
            self._check_length(seq, _at(field, i, single))
        return out

    def pairs(self, query: str, documents: Seq[str], truncate: bool) -> list[Sequence]:
        """Cross-encoder inputs: (query, document) pairs with their segment ids."""
        tokenizer = self.cutting if truncate else self.plain
        encodings = tokenizer.encode_batch([(query, d) for d in documents])
        out = [Sequence(list(e.ids), list(e.type_ids)) for e in encodings]
        for i, seq in enumerate(out):
            self._check_length(seq, f"documents[{i}]")
        return out

    def token_arrays(
        self, arrays: Seq[Seq[int]], field: str, truncate: bool, single: bool = False
    ) -> list[Sequence]:
        out = []
        for i, ids in enumerate(arrays):
            where = _at(field, i, single)
            if not ids:
                raise invalid(f"{where}: a token array must not be empty", where)
            for j, token in enumerate(ids):
                if not 0 <= token < self.vocab_size:
                    raise invalid(
                        f"{where}[{j}]: token id {token} is outside the vocabulary"
                        f" (0..{self.vocab_size - 1})",
                        where,
                    )
            seq = Sequence(list(ids[: self.max_length] if truncate else ids))
            self._check_length(seq, where)
            out.append(seq)
        return out

    def _check_length(self, seq: Sequence, where: str) -> None:
        if len(seq.ids) > self.max_length:
            raise ApiError(
                "invalid_request",
                f"{where} is {len(seq.ids)} tokens long; this model takes at most"
                f" {self.max_length} tokens per input (send `truncate: true` to cut it)",
                where,
            )


def _at(field: str, index: int, single: bool) -> str:
    """`input[3]` for a list, `input` for the single input a request sent."""
    return field if single else f"{field}[{index}]"
