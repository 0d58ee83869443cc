"""A GGUF file's tokenizer (`tokenizer.ggml.*` metadata) as a `tokenizers.Tokenizer`.

Built the way transformers builds it from the same file (its GGUF integration is the reference
the tests compare against, token for token):
- `gpt2`: byte-level BPE from the tokens and merges; the split regex named by `tokenizer.ggml.pre`
  where it differs from GPT-2's (llama3-style, qwen2), else GPT-2's own.
- `llama`: SentencePiece-style BPE with byte fallback; merges from the file, or recovered from the
  token scores as SentencePiece's BPE extraction does; a `▁` prefix when `add_space_prefix`.
Control tokens (type 3) are special added tokens, user-defined ones (type 4) plain added tokens,
and BOS/EOS are added by a post-processor when `add_bos_token` / `add_eos_token` say so.
"""

from __future__ import annotations

from functools import cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from engine_service.model.errors import CheckpointError
from engine_service.model.gguf_reader import GGUFFile

CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> the split regex; any other value splits as GPT-2 does (as transformers).
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "megrez": _QWEN2_SPLIT,
}
TOKENIZER_MODELS = ("gpt2", "llama")


@cache
def _byte_spelling() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def _byte_level(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer:
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    pairs = [tuple(merge.split(" ")) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False, dropout=None))
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges recovered from a SentencePiece vocabulary: every split of a token into two tokens,
    best score first (transformers' `generate_merges`)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    by_score = dict(zip(tokens, scores, strict=True))
    found: list[tuple[str, str, float]] = []
    for merged, score in by_score.items():
        local = [(merged[:i], merged[i:], score) for i in range(1, len(merged))
                 if merged[:i] in vocab and merged[i:] in vocab]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _sentencepiece(tokens: list[str], merges: list[str] | None, scores: list[float] | None,
                   prefix_space: bool, gguf: GGUFFile) -> Tokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges:
        pairs = [tuple(merge.split(" ")) for merge in merges]
    elif scores is not None and len(scores) == len(tokens):
        pairs = spm_merges(tokens, scores)
    else:
        raise CheckpointError(
            f"GGUF file {str(gguf.path)!r}: a 'llama' tokenizer needs 'tokenizer.ggml.merges' or one "
            f"'tokenizer.ggml.scores' entry per token, got neither"
        )
    unk = "<unk>" if "<unk>" in vocab else None
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None,
                                     unk_token=unk))
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix_space
                                                       else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _token(tokens: list[str], gguf: GGUFFile, key: str) -> tuple[str, int] | None:
    token_id = gguf.get(key, int)
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise CheckpointError(
            f"GGUF file {str(gguf.path)!r}: metadata {key!r} is {token_id}, outside the {len(tokens)} tokens"
        )
    return tokens[token_id], token_id


def build_gguf_tokenizer(gguf: GGUFFile) -> Tokenizer:
    """The tokenizer the file's metadata describes. Raises CheckpointError naming the key."""
    kind = gguf.require("tokenizer.ggml.model", str)
    if kind not in TOKENIZER_MODELS:
        raise CheckpointError(
            f"GGUF file {str(gguf.path)!r}: tokenizer model {kind!r} is not supported "
            f"(supported: {', '.join(TOKENIZER_MODELS)})"
        )
    tokens = gguf.require("tokenizer.ggml.tokens", list)
    merges = gguf.get("tokenizer.ggml.merges", list)
    types = gguf.get("tokenizer.ggml.token_type", list) or []
    if kind == "gpt2":
        if not merges:
            raise CheckpointError(f"GGUF file {str(gguf.path)!r}: a 'gpt2' tokenizer needs 'tokenizer.ggml.merges'")
        tokenizer = _byte_level(tokens, merges, gguf.get("tokenizer.ggml.pre", str))
        spelled = set(_byte_spelling().values())
    else:
        prefix_space = gguf.get("tokenizer.ggml.add_space_prefix", bool, True)
        tokenizer = _sentencepiece(tokens, merges, gguf.get("tokenizer.ggml.scores", list), prefix_space, gguf)
        spelled = None
    # A control token spelled outside the byte alphabet of a byte-level vocabulary is a converter's
    # mislabel: adding it would grow the vocabulary past the model's (transformers skips it too).
    control = [AddedToken(token, normalized=False, special=True) for token, kind_ in zip(tokens, types, strict=False)
               if kind_ == CONTROL and (spelled is None or set(token) <= spelled)]
    if control:
        tokenizer.add_special_tokens(control)
    vocab = tokenizer.get_vocab()
    user = [AddedToken(token, normalized=False, special=False) for token, kind_ in zip(tokens, types, strict=False)
            if kind_ == USER_DEFINED and token in vocab]
    if user:
        tokenizer.add_tokens(user)
    bos = _token(tokens, gguf, "tokenizer.ggml.bos_token_id")
    eos = _token(tokens, gguf, "tokenizer.ggml.eos_token_id")
    add_bos = gguf.get("tokenizer.ggml.add_bos_token", bool, kind == "llama") and bos is not None
    add_eos = gguf.get("tokenizer.ggml.add_eos_token", bool, False) and eos is not None
    single = " ".join([f"{bos[0]}:0"] * add_bos + ["$A:0"] + [f"{eos[0]}:0"] * add_eos)  # type: ignore[index]
    pair = single + " " + " ".join([f"{bos[0]}:1"] * add_bos + ["$B:1"] + [f"{eos[0]}:1"] * add_eos)  # type: ignore[index]
    specials = [t for t, add in ((bos, add_bos), (eos, add_eos)) if add and t is not None]
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    return tokenizer
