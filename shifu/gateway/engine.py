"""The gateway's sampler: chat completions merged into calls of shifu's own sampler
(:func:`shifu.generation.rollout.sample`, the one PPO samples with).

A :class:`Job` is one request's prompt ids with its ``n``, token budget, stop strings and sampling setting.
Jobs of one setting (greedy or not, temperature, top-p, top-k) merge into one call (:meth:`Engine.joins`,
through :class:`shifu.http.batching.BatchQueue`): their prompts left-padded to one width, ``n`` rows each,
within ``max_batch_rows`` rows, ``max_batch_tokens`` rows x (prompt + budget) tokens and the model's
positions. Per-row budgets, end-of-turn ids other than EOS and stop strings end rows through
:class:`shifu.generation.stops.RowStops`. A job with a ``seed`` is sampled in a call of its own with a
generator seeded by it (the same request with the same seed gets the same tokens). A recorded completion
(a job with an ``identity``: its session's row and the call's index in the session) samples each choice from
a generator of its own, seeded by the engine's seed and the identity with the choice's index
(:func:`choice_seed`): its randomness is the same whatever else shares its sampler call and whenever it
arrives. The others share the engine's generator.

Each choice comes back with its sampled ids (the ending EOS or end-of-turn id included when sampled) and
their float32 log-probs under ``logits / T`` at the sampling temperature (T = 1 when greedy), read off the
decode steps: the values :func:`shifu.generation.rollout.policy_forward` recomputes at the same T up to
float rounding. ``top_logprobs`` are read off the same steps: the most likely ids of the distribution each
token was sampled from, so a token's own log-prob is among them exactly whenever it is one of the most likely.

**Prefix reuse.** With ``prefix_cache_bytes`` > 0 the keys and values of every row's prompt and completion are
kept between calls (:class:`shifu.generation.kv_cache.PrefixCache`, least recently used blocks evicted past the
budget), and a call prefills only what its rows' cached prefixes leave: a session's next turn extends its last
prompt and completion, and sessions share their system prompt and tools block. A fork, a retry or a rewritten
history reuses the part it shares and prefills the rest. What is sampled and recorded is the same, up to the
float rounding of the log-probs (~1e-6), as with the cache off (0); new weights (:meth:`Engine.set_policy`)
empty it.

**Retiring rows.** A call's rows end at very different steps (a tool call of 20 tokens beside an answer of 200):
each leaves the decoder as it ends (:func:`shifu.generation.rollout.sample`'s ``retire``), so the later steps
forward only the rows still sampling. Every row keeps its own randomness (a recorded completion's generator, or
the same draws from a shared one), and the tokens are those of the static batch up to the float rounding of
forwards over fewer rows (``tests/test_engine_retire.py``: the same ids, log-probs within 1e-5).

**Admission.** With :attr:`Engine.admit` (the default) the gateway's queue runs :meth:`Engine.run_admitting`: a
request that arrives while a call decodes, of the call's setting and within its limits, joins it at the next step
(:class:`shifu.generation.continuous.Running`: its prompt prefilled through the prefix cache into rows and
columns of the running decoder's cache, its rows sampled beside the others from then on), and every request comes
back as its last row ends, not when the call does. A row's randomness is its own (a recorded completion's
generator) or a draw per step from the engine's generator, so a recorded completion samples the same ids
whether it ran alone, in a static call or joined one mid-decode (``tests/test_engine_admit.py``; log-probs within
1e-5). Requests with a ``seed`` or a ``grammar``, the models decoded through the HF forward (other
architectures, adapters other than plain LoRA), and calls holding any of them, run as static calls
(:meth:`Engine.run`); a pending request that may not join stops admission, so it waits for the running call
only. A recording gateway does not admit: its calls are formed in (row, call) order so that a seeded run
repeats bit for bit, and which rows share a step changes the float rounding of their log-probs (~1e-6), which a
decode joined as requests arrive would leave to timing.

**Paged memory.** The admitting loop keeps its rows' keys and values in blocks of a pool under
``kv_budget_bytes`` (:mod:`shifu.generation.paged`), each row's prompt and whole budget reserved as it joins, so
no running row is ever evicted: a request that does not fit beside the running rows waits in the queue until rows
end, one bigger than the whole budget is refused (:meth:`Engine.too_big`). Static calls keep their own cache.

**Grammars.** A job with a ``grammar`` (an llguidance grammar: the JSON schema of ``response_format``) has
each of its rows constrained by a matcher of it (``llguidance.LLMatcher``): before each step the tokens the
grammar does not allow get logit -1e30 (:func:`shifu.generation.rollout.sample`'s ``constrain``), so the row
samples, and reads its log-probs from, the constrained distribution; once the grammar is complete only an
end-of-turn id is allowed. Such log-probs are not those :func:`~shifu.generation.rollout.policy_forward`
recomputes: a recording gateway refuses grammars (:mod:`shifu.gateway.completions`).

**Streaming.** A job with ``on_text`` is told each of its choices' ids as they are sampled, on the sampler
thread, with the text each one adds (:class:`IncrementalText`): ``on_text(choice, token, text)`` once per step
and choice until the choice's ending id (included), ``token`` a :class:`Token` (the id, the log-prob its choice
returns and a session records, its ``top_logprobs``, their texts), in static calls and in the admitting loop
alike. It must only hand them over (the chat dialect puts them on the event loop,
:mod:`shifu.gateway.streaming`); what is sampled and returned does not change.
"""

from __future__ import annotations

import copy
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shifu.gateway.tokens import IncrementalText, Token
from shifu.generation.continuous import Row, Running
from shifu.generation.decode import keeps_kv, kv_shape
from shifu.generation.kv_cache import CallPrefixes, PrefixCache
from shifu.generation.paged import block_bytes, blocks_for
from shifu.generation.rollout import SamplingParams, sample
from shifu.generation.stops import RowStops, one_row
from shifu.models.padding import pad_left
from shifu.models.positions import position_limit


@dataclass
class Job:
    """One request's rows for the sampler (see the module docstring)."""

    prompt_ids: list[int]
    n: int
    budget: int
    stops: list[str]
    temperature: float  # > 0; ignored when greedy
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    seed: int | None = None
    top_logprobs: int = 0
    on_text: Callable[[int, Token, str], None] | None = None  # streaming: (choice, token, new text) per step
    grammar: str | None = None  # llguidance's grammar every choice's ids must follow (response_format)
    identity: tuple | None = None  # (row, call): a recorded completion's (see the module docstring)

    @property
    def setting(self) -> tuple:
        return (self.greedy, self.temperature, self.top_p, self.top_k)


@dataclass
class Choice:
    """One sampled completion: ``ids`` and their ``log_probs``; ``ended``: ``"eos"`` (EOS or another
    end-of-turn id, the last of ``ids``), ``"stop"`` (the stop string ``stop_hit``) or ``"length"``;
    ``top``: per token the ``top_logprobs`` most likely ``(id, log-prob)`` of the distribution it was sampled
    from, best first; ``version``: the policy's;
    ``entropy``: per token the entropy of the sampling distribution (``logits / T``), read off the same steps."""

    ids: list[int]
    log_probs: list[float]
    ended: str
    stop_hit: str | None
    top: list[list[tuple[int, float]]] | None
    version: int
    entropy: list[float] | None = None


def choice_seed(seed: int, identity: tuple, choice: int) -> int:
    """The seed of one choice of a recorded completion: 63 bits of sha256 over the engine's ``seed``, the
    completion's ``identity`` and the choice's index (the same numbers give the same seed on every platform)."""
    text = repr((int(seed), *identity, int(choice))).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


def call_params(first: Job, max_new_tokens: int) -> SamplingParams:
    """A call's sampling: its jobs share one setting (``Engine.joins``), read off the first."""
    temperature = 1.0 if first.greedy else first.temperature
    return SamplingParams(max_new_tokens, temperature, first.top_k, first.top_p, greedy=first.greedy)


def end_ids(model, tokenizer) -> list[int]:
    """Ids that end a turn: the tokenizer's EOS and every ``eos_token_id`` of the model's generation config
    (Llama 3's ``<|eot_id|>`` and ``<|end_of_text|>``)."""
    ids = {tokenizer.eos_token_id}
    cfg = getattr(model, "generation_config", None)
    extra = getattr(cfg, "eos_token_id", None)
    ids |= set(extra if isinstance(extra, (list, tuple)) else [extra])
    return sorted(i for i in ids if isinstance(i, int))


class Engine:
    """The policy and its sampling calls (module docstring). :meth:`run` runs on the queue's one worker
    thread; :meth:`set_policy` swaps the model between calls (a call samples with the model and version it
    started with)."""

    def __init__(
        self,
        model,
        tokenizer,
        version: int = 0,
        max_batch_rows: int = 64,
        max_batch_tokens: int = 65536,
        seed: int = 0,
        prefix_cache_bytes: int = 512 * 2**20,
        kv_budget_bytes: int = 1024 * 2**20,
    ):
        self.tok = tokenizer
        # the sampler thread's own copy (stop strings, streamed text, grammars): the gateway's tokenizing thread
        # uses the original, and a fast tokenizer is not to be called from two threads at once
        self.sampler_tok = copy.deepcopy(tokenizer)
        self.max_batch_rows, self.max_batch_tokens = max_batch_rows, max_batch_tokens
        self.seed, self.generator = seed, torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()
        self.calls = 0  # sampler calls run
        self.last_seconds = 0.0  # how long the last sampler call took
        self._ll = (None, None)  # (vocabulary size, llguidance tokenizer): grammars (_lltok)
        self.prefix = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.kv_budget = int(kv_budget_bytes)  # the admitting loop's pool (module docstring; > 0)
        self.kv = {"peak_bytes": 0, "waits": 0}  # the most its pool held; requests left waiting for room
        self.retire = True  # rows leave the decoder as they end (module docstring); False: the static batch
        self.admit = True  # requests join a running decode between its steps (module docstring)
        self.set_policy(model, version)

    def set_policy(self, model, version: int) -> None:
        with self._lock:
            self.model, self.version = model.eval(), int(version)
            self.positions = position_limit(model)
            self.end_ids = end_ids(model, self.tok)
            if self.prefix is not None:  # new weights: every kept key and value is stale
                self.prefix.clear()

    def prefix_counters(self) -> dict[str, float]:
        """The prefix cache's counters (:meth:`shifu.generation.kv_cache.PrefixCache.counters`); ``{}`` when
        it is off."""
        return {} if self.prefix is None else self.prefix.counters()

    def kv_blocks(self) -> int:
        """The blocks the admitting loop's pool holds for the policy (module docstring); 0 without one."""
        return self.kv_budget // self._block_bytes() if keeps_kv(self.model) else 0

    def _block_bytes(self) -> int:
        return block_bytes(kv_shape(self.model), next(self.model.parameters()).dtype)

    def kv_need(self, job: Job) -> int:
        """The blocks ``job``'s rows reserve in the admitting loop's pool: their prompt and whole budget."""
        return job.n * blocks_for(len(job.prompt_ids) + job.budget)

    def too_big(self, job: Job) -> str | None:
        """Why ``job`` can never be admitted (its rows need more than the whole KV budget), or None."""
        if not self.admits(job) or self.kv_need(job) <= self.kv_blocks():
            return None
        need_mb, have_mb = self.kv_need(job) * self._block_bytes() / 2**20, self.kv_budget / 2**20
        return (
            f"the request's {job.n} choice(s) of {len(job.prompt_ids)} prompt tokens + max_tokens "
            f"{job.budget} need {need_mb:.1f} MB of keys and values, more than the gateway's KV budget "
            f"({have_mb:.1f} MB): lower max_tokens or n, send a shorter conversation, or serve with a larger "
            "--kv-budget-mb"
        )

    def kv_counters(self) -> dict[str, float]:
        """The pool's budget, the most it held at once, the times a request was left waiting for room."""
        return {"budget_bytes": self.kv_budget, **self.kv}

    def joins(self, jobs: list[Job], job: Job) -> bool:
        """Whether ``job`` may be sampled in one call with ``jobs`` (module docstring)."""
        if job.seed is not None or jobs[0].seed is not None or job.setting != jobs[0].setting:
            return False
        if (job.identity is None) != (jobs[0].identity is None):  # (one way of drawing per call)
            return False
        rows = sum(j.n for j in jobs) + job.n
        width = max(len(j.prompt_ids) for j in (*jobs, job)) + max(j.budget for j in (*jobs, job))
        fits = self.positions is None or width <= self.positions
        if self.admits(job) and all(self.admits(j) for j in jobs):  # the admitting loop's pool holds them all
            fits = fits and sum(self.kv_need(j) for j in (*jobs, job)) <= self.kv_blocks()
        return fits and rows <= self.max_batch_rows and rows * width <= self.max_batch_tokens

    @torch.no_grad()
    def run(self, jobs: list[Job]) -> list[list[Choice]]:
        """One sampler call for ``jobs`` (on the worker thread): each job's ``n`` choices."""
        rows = [j for j in jobs for _ in range(j.n)]
        with self._lock:  # (a prefix cache emptied by set_policy from here on keeps nothing of this call)
            model, version = self.model, self.version
            prefix = None if self.prefix is None else CallPrefixes(self.prefix, [j.prompt_ids for j in rows])
        first = jobs[0]
        device = next(model.parameters()).device
        enc = pad_left([j.prompt_ids for j in rows], self.tok.pad_token_id)
        params = call_params(first, max(j.budget for j in rows))
        gen = self._generators(jobs)
        ends = [i for i in self.end_ids if i != self.tok.eos_token_id]
        stops = RowStops(self.sampler_tok, [j.budget for j in rows], [j.stops for j in rows], ends)
        tops = {b: [] for b, j in enumerate(rows) if j.top_logprobs}  # per row asking, per token (_hooks)
        t0 = time.perf_counter()
        out = sample(
            model,
            enc["input_ids"].to(device),
            enc["attention_mask"].to(device),
            params,
            self.tok.eos_token_id,
            self.tok.pad_token_id,
            generator=gen,
            with_log_probs=True,
            stop=stops,
            prefix=prefix,
            retire=self.retire,
            **self._hooks(rows, model, tops),
        )
        self.calls += 1
        self.last_seconds = time.perf_counter() - t0
        choices = []
        for b in range(len(rows)):
            mask = out.response_mask[b].cpu()
            ids = out.response_ids[b].cpu()[mask].tolist()
            log_probs = out.log_probs[b].cpu()[mask].tolist()
            entropy = out.entropy[b].cpu()[mask].tolist()
            ended = "eos" if ids and ids[-1] in self.end_ids else (stops.reasons[b] or "length")
            choices.append(Choice(ids, log_probs, ended, stops.hits[b], tops.get(b), version, entropy))
        grouped, at = [], 0
        for j in jobs:
            grouped.append(choices[at : at + j.n])
            at += j.n
        return grouped

    def admits(self, job: Job) -> bool:
        """Whether ``job`` may decode in a loop that admits requests between its steps (:meth:`run_admitting`):
        with :attr:`admit` on, a decoder that keeps its own cache, no ``seed`` and no ``grammar``."""
        return self.admit and job.seed is None and job.grammar is None and keeps_kv(self.model)

    @torch.no_grad()
    def run_admitting(self, jobs: list[Job], feed) -> list[list[Choice]]:
        """One decode loop for ``jobs`` and the jobs of their setting that arrive while it decodes (module
        docstring), on the worker thread: ``feed.more(accept)`` hands over the pending jobs ``accept`` takes,
        ``feed.deliver(index, choices)`` each job's choices as its last row ends (index: the job's among
        ``jobs`` then those handed over). Jobs that may not admit others run as :meth:`run` does."""
        if not all(self.admits(j) for j in jobs):
            return self.run(jobs)
        with self._lock:
            model, version = self.model, self.version
        first, t0 = jobs[0], time.perf_counter()
        params = call_params(first, max(j.budget for j in jobs))
        taken: list[Job] = []
        results: list[list[Choice | None]] = []

        def on_end(row: Row) -> None:
            index, c, stops = row.tag
            job = taken[index]
            ids = row.ids
            ended = "eos" if ids and ids[-1] in self.end_ids else (stops.reasons[0] or "length")
            top = row.top if job.top_logprobs else None
            results[index][c] = Choice(ids, row.log_probs, ended, stops.hits[0], top, version, row.entropy)
            if all(x is not None for x in results[index]):
                feed.deliver(index, results[index])

        generator = None if first.identity is not None else self.generator
        eos, pad, batch = self.tok.eos_token_id, self.tok.pad_token_id, sum(j.n for j in jobs)
        loop = Running(model, params, eos, pad, on_end, generator, self.prefix, batch, self.kv_budget)
        loop.admit(self._admitted(jobs, taken, results))
        while True:
            loop.step()
            self.kv["peak_bytes"] = max(self.kv["peak_bytes"], loop.pool.peak * loop.pool.block_bytes)
            more = feed.more(self._acceptor(loop, first, version, taken))
            if more:
                loop.admit(self._admitted(more, taken, results))
            if not loop.rows:
                break
        self.calls += 1
        self.last_seconds = time.perf_counter() - t0
        return results

    def _acceptor(self, loop: Running, first: Job, version: int, taken: list[Job]) -> Callable[[Job], bool]:
        """``accept(job)`` for :meth:`run_admitting`'s ``feed.more``: a job of the loop's setting that fits beside
        the rows held and those accepted before it (:meth:`joins`' limits), while the policy is the loop's."""
        rows = len(loop.rows)
        width = max((len(r.prompt) + r.budget for r in loop.rows), default=0)
        accepted: list[int] = []  # the tokens each row accepted so far may hold (its prompt and whole budget)

        def accept(job: Job) -> bool:
            nonlocal rows, width
            if self.version != version or job.setting != first.setting or not self.admits(job):
                return False
            if (job.identity is None) != (first.identity is None):
                return False
            wide = max(width, len(job.prompt_ids) + job.budget)
            if self.positions is not None and len(job.prompt_ids) + job.budget > self.positions:
                return False
            if rows + job.n > self.max_batch_rows or (rows + job.n) * wide > self.max_batch_tokens:
                return False
            need = [len(job.prompt_ids) + job.budget] * job.n
            if not loop.room(*accepted, *need):  # it waits until rows end (module docstring)
                self.kv["waits"] += 1
                return False
            rows, width = rows + job.n, wide
            accepted.extend(need)
            return True

        return accept

    def _admitted(self, jobs: list[Job], taken: list[Job], results: list) -> list[Row]:
        """The rows of ``jobs`` for :class:`~shifu.generation.continuous.Running` (each with its stops, its
        generator when recorded, its streaming hook), the jobs added to ``taken`` and ``results``."""
        ends = [i for i in self.end_ids if i != self.tok.eos_token_id]
        rows = []
        for job in jobs:
            index = len(taken)
            taken.append(job)
            results.append([None] * job.n)
            for c in range(job.n):
                stops = RowStops(self.sampler_tok, [job.budget], [job.stops], ends)
                gen = None
                if job.identity is not None:
                    gen = torch.Generator().manual_seed(choice_seed(self.seed, job.identity, c))
                rows.append(
                    Row(
                        job.prompt_ids,
                        job.budget,
                        stop=one_row(stops),
                        generator=gen,
                        on_token=self._streamer(job, c),
                        tag=(index, c, stops),
                        top_logprobs=job.top_logprobs,
                    )
                )
        return rows

    def _streamer(self, job: Job, choice: int) -> Callable | None:
        """A row's ``on_token``: ``job.on_text`` told each id and the text it adds (module docstring)."""
        if job.on_text is None:
            return None
        text = IncrementalText(self.sampler_tok)
        return lambda token, log_prob, top: job.on_text(
            choice, self._token(token, log_prob, top), text.add(token)
        )

    def _token(self, token: int, log_prob: float, top: list[tuple[int, float]] | None) -> Token:
        """The :class:`Token` a streaming job is told (on the sampler thread: its own tokenizer)."""
        decode = self.sampler_tok.decode
        alts = None if top is None else [(i, decode([i]), lp) for i, lp in top]
        return Token(token, log_prob, decode([token]), alts)

    def _hooks(self, rows: list[Job], model, tops: dict[int, list]) -> dict:
        """The sampler's ``on_step`` (each streaming job told its choices' new ids and text, each grammar's
        matcher its row's id, each row in ``tops`` its step's ``top_logprobs`` appended) and ``constrain`` (the
        grammars' masks), for the rows that need them (module docstring)."""
        listening = [(b, j) for b, j in enumerate(rows) if j.on_text is not None]
        matchers = {b: self._matcher(j.grammar, model) for b, j in enumerate(rows) if j.grammar is not None}
        if not listening and not matchers and not tops:
            return {}
        choice = {b: sum(1 for r in rows[:b] if r is j) for b, j in listening}  # row -> index among its job's
        texts = {b: IncrementalText(self.sampler_tok) for b, _ in listening}
        live = set(matchers)

        def on_step(t: int, tokens: torch.Tensor, real: torch.Tensor, logp: torch.Tensor) -> None:
            tokens, real = tokens.tolist(), real.tolist()
            for b, matcher in matchers.items():
                if b in live and real[b]:
                    matcher.consume_token(tokens[b])
                elif b in live:
                    live.discard(b)  # ended: nothing more to constrain
            step_top = {}
            for b, kept in tops.items():
                if real[b]:
                    values, index = logp[b].topk(rows[b].top_logprobs)
                    step_top[b] = list(zip(index.tolist(), values.tolist()))
                    kept.append(step_top[b])
            for b, job in listening:
                if real[b]:  # the log-prob as the call returns it: the same float32 of the same step
                    lp = logp[b, tokens[b]].item()
                    job.on_text(
                        choice[b], self._token(tokens[b], lp, step_top.get(b)), texts[b].add(tokens[b])
                    )

        if not matchers:
            return {"on_step": on_step}
        return {"on_step": on_step, "constrain": self._constrainer(matchers, live)}

    def _constrainer(self, matchers: dict, live: set) -> Callable:
        """The sampler's ``constrain``: each live row's grammar mask on its logits (module docstring)."""
        bit = torch.arange(32, dtype=torch.int32)

        def constrain(t: int, logits: torch.Tensor) -> None:
            for b in sorted(live):
                if matchers[b].is_error():
                    raise RuntimeError(f"the grammar's matcher failed: {matchers[b].get_error()}")
                # llguidance's bitmask: bit i % 32 of 32-bit word i // 32 is set when token i is allowed
                words = torch.frombuffer(bytearray(matchers[b].compute_bitmask()), dtype=torch.int32)
                allowed = ((words.unsqueeze(-1) >> bit) & 1).flatten()[: logits.shape[-1]].bool()
                # -1e30, not -inf: the entropy of a row with excluded tokens stays a number
                logits[b].masked_fill_(~allowed.to(logits.device), -1e30)

        return constrain

    def _lltok(self, model):
        """llguidance's view of the tokenizer over the model's vocabulary, its end-of-turn ids ending a
        complete grammar (built once per vocabulary size)."""
        import llguidance.hf

        vocab = model.get_output_embeddings().weight.shape[0]
        if self._ll[0] != vocab:
            self._ll = (
                vocab,
                llguidance.hf.from_tokenizer(self.sampler_tok, n_vocab=vocab, eos_token=self.end_ids),
            )
        return self._ll[1]

    def _matcher(self, grammar: str, model):
        import llguidance

        return llguidance.LLMatcher(self._lltok(model), grammar)

    def _generators(self, jobs: list[Job]) -> torch.Generator | list[torch.Generator]:
        """A call's randomness (module docstring): one generator per row for recorded completions, else the
        request's seed or the engine's generator."""
        if jobs[0].identity is not None:
            seeds = [choice_seed(self.seed, j.identity, c) for j in jobs for c in range(j.n)]
            return [torch.Generator().manual_seed(s) for s in seeds]
        return self.generator if jobs[0].seed is None else torch.Generator().manual_seed(jobs[0].seed)
