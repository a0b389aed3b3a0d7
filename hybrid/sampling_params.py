"""Per-request generation settings, validated when the request is made."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybrid.invalid_request import InvalidRequest, lone_surrogate_at

# Below this temperature sampling is greedy: dividing logits by it would overflow float32.
GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20
MAX_TOP_K = 2**31 - 1  # top_k goes over the wire as an int; any k above the vocabulary keeps every token
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 1024  # tokens one request may bias (OpenAI's own limit is lower)
MAX_ALLOWED_TOKEN_IDS = 2**18  # more than any vocabulary has
MAX_BAD_WORDS = 256  # token sequences (a word given to the API becomes one or two)
MAX_BAD_WORD_TOKENS = 64
MAX_CACHE_SALT_CHARS = 1024


@dataclass
class SamplingParams:
    """temperature 0 (or below GREEDY_BELOW) means greedy; top_k 0 and top_p 1 disable those filters; seed makes
    sampling repeatable. logprobs=k reports each generated token's log-probability and the k most likely
    alternatives; prompt_logprobs=k does the same for the prompt's tokens (the first has none). grammar (Lark text, see
    hybrid/structured_output) restricts the completion to what it derives; the request ends when it is complete.
    presence / frequency penalties (OpenAI's), repetition_penalty (HF's and vLLM's, over prompt and completion),
    logit_bias (token id: bias), min_tokens (no end of sequence or stop before that many tokens),
    allowed_token_ids (only these may be drawn; None: any) and bad_words_ids (token sequences the completion never
    ends with: a sequence's last token is barred where the completion ends with the ones before it) adjust the
    logits before drawing (engine/logits_processors.py); min_p drops tokens less likely than min_p times the most
    likely one when sampling. The text ends before the stop string it met, or after it with
    include_stop_str_in_output. cache_salt (vLLM's) keeps the request's prompt out of reach of requests with
    another salt or none in the prefix cache: cached KV is shared only between requests of the same salt."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words_ids: list[list[int]] = field(default_factory=list)
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(f"temperature must be in [0, 100], got {self.temperature}", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequest(f"top_k must be in [0, 2**31), got {self.top_k}", param="top_k")
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty", param="stop")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise InvalidRequest(f"seed must be in [-2**63, 2**64), got {self.seed}", param="seed")
        if self.grammar is not None and not self.grammar.strip():
            raise InvalidRequest("grammar must not be empty", param="grammar")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {getattr(self, name)}", param=name)
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequest(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got "
                                 f"{self.repetition_penalty}", param="repetition_penalty")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        if any(not isinstance(t, int) or isinstance(t, bool) for t in self.logit_bias):
            raise InvalidRequest("logit_bias keys must be token ids (integers)", param="logit_bias")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}",
                                 param="logit_bias")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise InvalidRequest("logit_bias values must be in [-100, 100]", param="logit_bias")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
                                 param="min_tokens")
        if self.allowed_token_ids is not None and not 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS:
            raise InvalidRequest(f"allowed_token_ids must name 1 to {MAX_ALLOWED_TOKEN_IDS} tokens, got "
                                 f"{len(self.allowed_token_ids)}", param="allowed_token_ids")
        if len(self.bad_words_ids) > MAX_BAD_WORDS:
            raise InvalidRequest(f"bad_words_ids may hold at most {MAX_BAD_WORDS} sequences, got "
                                 f"{len(self.bad_words_ids)}", param="bad_words")
        if any(not 0 < len(w) <= MAX_BAD_WORD_TOKENS for w in self.bad_words_ids):
            raise InvalidRequest(f"bad_words_ids: each sequence must have 1 to {MAX_BAD_WORD_TOKENS} tokens",
                                 param="bad_words")
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise InvalidRequest(f"cache_salt must have 1 to {MAX_CACHE_SALT_CHARS} characters, got "
                                 f"{len(self.cache_salt)}", param="cache_salt")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise InvalidRequest(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}", param=name)
        for name, texts in (("stop", self.stop), ("grammar", [self.grammar]), ("cache_salt", [self.cache_salt])):
            if any(t is not None and lone_surrogate_at(t) is not None for t in texts):
                raise InvalidRequest(f"{name} holds a lone surrogate: text that is not valid Unicode", param=name)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
