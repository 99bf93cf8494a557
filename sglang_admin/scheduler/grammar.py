"""Constrained decoding on a rank: compile off the step loop, cache, one matcher per request.

A request with a constraint (``SamplingParams.grammar_kind``) does not enter the waiting
queue at once: :class:`GrammarQueue` holds it while a thread pool compiles its grammar
(GetLoads' ``queues.grammar`` counts it), so a slow compile never stalls the steps of the
other requests. Compiled grammars are cached (LRU keyed by kind and text; a failure is
cached too, a grammar that does not compile will not compile the next time either), and a
second request for a grammar still compiling waits for the same compile.

:class:`XGrammarBackend` compiles with xgrammar (SGLang's default backend) against the
served model's tokenizer: the ``tokenizers`` vocabulary of its tokenizer.json, the vocabulary
type xgrammar detects from that file, and the model's vocabulary size (ids past the
tokenizer's vocabulary are padding and always masked). Every request then gets its own
:class:`GrammarState` (an xgrammar matcher): the model runner fills its token bitmask each
step, the scheduler accepts each sampled token into it and finishes the request with "stop"
once the matcher is terminated.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sglang_admin.messages import GRAMMAR_KINDS
from sglang_admin.scheduler import late_imports

logger = logging.getLogger(__name__)

DEFAULT_CACHE_ENTRIES = 256
DEFAULT_COMPILE_WORKERS = 2
ANY_JSON = "$$ANY$$"  # json_schema text SGLang reads as "any JSON value" (json_object mode)
# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:NN: "
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")

R = TypeVar("R")


class GrammarError(ValueError):
    """A constraint that does not compile; the message is the compiler's, cleaned up."""


class GrammarUnavailable(RuntimeError):
    """This rank cannot compile grammars at all (no tokenizer for the model)."""


class GrammarState:
    """The matcher of one request (one sample): what the next token may be, and whether the
    constraint is complete. Made from a compiled grammar; :meth:`fork` gives a sibling
    sample (n > 1) its own fresh matcher at the same point."""

    def __init__(self, compiled: Any, stop_token_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr

        self.compiled = compiled
        self.stop_token_ids = stop_token_ids
        self.matcher = xgr.GrammarMatcher(
            compiled, override_stop_tokens=list(stop_token_ids) or None
        )

    def fill_next_token_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of an xgrammar token bitmask."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def finished(self) -> bool:
        """The constraint is satisfied and nothing may follow: the request stops. A model
        with no stop token ends as soon as the grammar is complete."""
        if self.matcher.is_terminated():
            return True
        return not self.stop_token_ids and self.matcher.is_completed()

    def fork(self) -> GrammarState:
        """A new state with its own matcher, at the same point of the grammar."""
        twin = GrammarState.__new__(GrammarState)
        twin.compiled = self.compiled
        twin.stop_token_ids = self.stop_token_ids
        twin.matcher = self.matcher.fork()
        return twin


def compiler_message(exc: BaseException) -> str:
    """The compiler's message without xgrammar's time stamp and source location."""
    text = str(exc).strip()
    return _XGRAMMAR_PREFIX.sub("", text) or type(exc).__name__


class XGrammarBackend:
    """Compiles constraints with xgrammar against the served model's tokenizer.

    The tokenizer file is read at once (the model directory may go away once loaded); the
    tokenizer info is built on first use, in a compile thread (a large vocabulary takes a
    while), and every compile after that reuses it.
    """

    def __init__(
        self,
        tokenizer_file: str | None,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        max_threads: int = DEFAULT_COMPILE_WORKERS,
    ) -> None:
        self.tokenizer: Any = None
        self.unavailable = (
            "constrained decoding needs the model's tokenizer.json, and this model has none"
        )
        if tokenizer_file:
            from tokenizers import Tokenizer

            try:
                self.tokenizer = Tokenizer.from_file(tokenizer_file)
                self.unavailable = ""
            except Exception as exc:  # noqa: BLE001 - the rank serves on, unconstrained only
                self.unavailable = f"the tokenizer {tokenizer_file} does not load: {exc}"
                logger.warning("constrained decoding is off: %s", self.unavailable)
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(t for t in stop_token_ids if 0 <= t < vocab_size)
        self.max_threads = max_threads
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                # in a compile thread: xgrammar is imported by the rank's late-imports
                # thread (an import here while the loop ran torch ops froze a rank)
                late_imports.wait_for_grammar()
                import xgrammar as xgr

                if self.tokenizer is None:
                    raise GrammarUnavailable(self.unavailable)
                info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                # xgrammar's own cache stays off: GrammarQueue caches (and bounds) it
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=self.max_threads, cache_enabled=False
                )
            return self._compiler

    def compile(self, kind: str, text: str) -> Any:
        """The compiled grammar; raises :class:`GrammarError` with the compiler's message."""
        compiler = self._get_compiler()
        try:
            return _compile(compiler, kind, text)
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError, ...
            raise GrammarError(f"{kind} does not compile: {compiler_message(exc)}") from None

    def new_state(self, compiled: Any) -> GrammarState:
        return GrammarState(compiled, self.stop_token_ids)


def tokenizer_info(tok: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> Any:
    """xgrammar's TokenizerInfo from a ``tokenizers.Tokenizer`` (not a transformers one): the
    vocabulary in id order, padded with empty tokens up to the model's vocabulary size, and
    the vocabulary type xgrammar detects from the tokenizer's JSON."""
    import xgrammar as xgr

    # Exactly the model's width (the logits'): ids past the tokenizer are padding (never
    # allowed), tokenizer ids past the model's vocabulary can never be sampled (dropped).
    encoded: list[str] = [""] * vocab_size
    for token, idx in tok.get_vocab(with_added_tokens=True).items():
        if 0 <= idx < vocab_size:
            encoded[idx] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
    return xgr.TokenizerInfo(
        encoded,
        meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=list(stop_token_ids) or None,
        add_prefix_space=meta["add_prefix_space"],
    )


def _compile(compiler: Any, kind: str, text: str) -> Any:
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "ebnf_grammar":
        return compiler.compile_grammar(text)
    if kind == "json_schema":
        if text.strip() == ANY_JSON:
            return compiler.compile_builtin_json_grammar()
        # Compact JSON: unbounded whitespace would let a model pad forever
        return compiler.compile_json_schema(text, any_whitespace=False)
    if kind == "structural_tag":
        return _compile_structural_tag(compiler, text)
    raise GrammarError(f"unknown constraint kind {kind!r}; valid: {', '.join(GRAMMAR_KINDS)}")


def _compile_structural_tag(compiler: Any, text: str) -> Any:
    """SGLang's (legacy) {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, or
    xgrammar's structural tag format as it is."""
    import xgrammar as xgr

    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"structural_tag is not JSON: {exc}") from None
    if isinstance(spec, dict) and "structures" in spec and "triggers" in spec:
        try:
            tags = [
                xgr.StructuralTagItem(
                    begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]
                )
                for s in spec["structures"]
            ]
        except (KeyError, TypeError) as exc:
            raise GrammarError(
                "structural_tag.structures entries need begin, schema and end "
                f"({type(exc).__name__}: {exc})"
            ) from None
        return compiler.compile_structural_tag(tags, list(spec["triggers"]))
    return compiler.compile_structural_tag(text)


@dataclass
class Compiled(Generic[R]):
    """A request whose grammar is ready: its state, or the reason it failed."""

    req: R
    state: GrammarState | None
    error: str | None = None
    code: str = "INVALID_ARGUMENT"


class GrammarQueue(Generic[R]):
    """Requests waiting for their grammar, compiled by a thread pool, with an LRU cache.

    ``compile(kind, text)`` returns a compiled grammar or raises (GrammarError: the caller's
    mistake; GrammarUnavailable: the rank's); ``new_state(compiled)`` makes a request's
    matcher. Only the rank's loop thread calls the methods here; the pool only compiles.
    """

    def __init__(
        self,
        compile: Callable[[str, str], Any],
        new_state: Callable[[Any], GrammarState],
        workers: int = DEFAULT_COMPILE_WORKERS,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
    ) -> None:
        self._compile = compile
        self._new_state = new_state
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._cache_entries = cache_entries
        self._waiting: list[tuple[R, Future]] = []
        self.cache_hits = 0
        self.cache_misses = 0

    @classmethod
    def for_backend(
        cls, backend: XGrammarBackend, workers: int = DEFAULT_COMPILE_WORKERS
    ) -> GrammarQueue:
        """A queue compiling with ``backend``. The tokenizer info is built by the first
        constrained request's compile, in the pool. xgrammar is imported by the rank's
        late-imports thread once the rank is ready (scheduler/late_imports.py); the first
        compile waits for it in the pool, never on the loop."""
        return cls(backend.compile, backend.new_state, workers=workers)

    def __len__(self) -> int:
        """Requests waiting for a compile (GetLoads' queues.grammar)."""
        return len(self._waiting)

    def submit(self, req: R, kind: str, text: str) -> None:
        """Queue ``req`` until its grammar is compiled (at once when cached)."""
        self._waiting.append((req, self._future(kind, text)))

    def _future(self, kind: str, text: str) -> Future:
        key = (kind, text)
        fut = self._cache.get(key)
        if fut is not None:
            self._cache.move_to_end(key)
            self.cache_hits += 1
            return fut
        self.cache_misses += 1
        fut = self._pool.submit(self._compile, kind, text)
        self._cache[key] = fut
        while len(self._cache) > self._cache_entries:
            self._cache.popitem(last=False)
        return fut

    def poll(self) -> list[Compiled[R]]:
        """The requests whose compile finished, in arrival order, each with its own matcher
        or the compiler's message; the others keep waiting."""
        if not self._waiting:
            return []
        ready: list[Compiled[R]] = []
        still: list[tuple[R, Future]] = []
        for req, fut in self._waiting:
            if not fut.done():
                still.append((req, fut))
                continue
            ready.append(self._resolve(req, fut))
        self._waiting = still
        return ready

    def _resolve(self, req: R, fut: Future) -> Compiled[R]:
        try:
            return Compiled(req, self._new_state(fut.result()))
        except GrammarError as exc:
            return Compiled(req, None, str(exc))
        except GrammarUnavailable as exc:
            self._forget(fut)
            return Compiled(req, None, str(exc), "FAILED_PRECONDITION")
        except Exception as exc:  # noqa: BLE001 - the compiler's bug fails that request only
            logger.exception("grammar compile failed unexpectedly")
            self._forget(fut)
            return Compiled(req, None, f"grammar compile failed: {type(exc).__name__}: {exc}",
                            "INTERNAL")

    def _forget(self, fut: Future) -> None:
        """Drop a failure that is not the grammar's fault from the cache (retry next time)."""
        for key, cached in list(self._cache.items()):
            if cached is fut:
                del self._cache[key]

    def remove(self, req: R) -> bool:
        """Take ``req`` out of the queue (abort, expiry); False when it was not there."""
        for i, (queued, _) in enumerate(self._waiting):
            if queued is req:
                del self._waiting[i]
                return True
        return False

    def requests(self) -> list[R]:
        return [req for req, _ in self._waiting]

    def drain(self) -> list[R]:
        """Take every waiting request out (abort all, fail all)."""
        reqs = self.requests()
        self._waiting = []
        return reqs

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
