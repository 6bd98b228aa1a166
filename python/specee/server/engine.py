"""The batching thread: jobs wait in a bounded queue for a free slot, one thread steps the slots.

The batching loop itself is the library's (csrc/serve/specee-slots.cpp); `Engine` only admits waiting jobs between
passes, calls `Slots.step()` (one pass of the model, the GIL released) and hands each job its tokens through the event
loop. LoRA adapters (--lora): the model's context has one set of scales, so requests run under one set at a time: a job
whose scales (its `lora`, else the server's, POST /lora-adapters) differ from those applied waits, with the jobs
behind it, until the running ones finish; then the new scales are applied, which empties every slot's cache and the
prompt cache (their K/V were computed under the old scales), as llama.cpp clears a slot's cache when its adapters
change. `ServerState` is what the endpoints share: the model, the engine and the server's settings. `unload` and
`load` take the model out and put one back while nothing runs (--sleep-idle-seconds, server/sleep.py): the queue,
the thread and the metrics stay.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from specee import _core
from specee.context_options import CONTEXT_OPTIONS
from specee.generate import MODES
from specee.model import Model
from specee.server.prompt_cache import PromptCache, common_prefix
from specee.server.reasoning import ThoughtBudget
from specee.server.request import ApiError, RequestParams
from specee.server.templates import ChatTemplate


@dataclass(eq=False)  # a job is itself: the queue finds it by identity
class Job:
    """One generation: its prompt and parameters, and what the batching thread sends back to the event loop."""

    tokens: list[int]
    params: RequestParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    slot: int | None = None
    cancelled: bool = False
    cached: int = 0  # prompt tokens its slot's cache held when it was admitted
    processed: int = -1  # prompt tokens in the cache at the last progress sent (return_progress); -1: none sent
    admitted: float = 0.0  # time.perf_counter() when a slot took it
    budget: ThoughtBudget | None = None  # its thinking budget's count (a copy of params.budget's)
    generated: list[int] = field(default_factory=list)  # with a budget: the tokens given out so far
    stats_before: dict[str, float] | None = None  # with a budget: the stats of its runs before a cut

    def __post_init__(self) -> None:
        self.budget = None if self.params.budget is None else replace(self.params.budget)

    def send(self, *event: Any) -> None:  # from the batching thread
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine:
    """The model, its slots and the thread that steps them; jobs wait in a bounded queue for a free slot."""

    def __init__(self, model: Model, n_parallel: int, max_queue: int, n_chunk: int, unified: bool = False,
                 context_shift: int | None = None, cache: PromptCache | None = None, cache_idle_slots: bool = False,
                 log: Callable[[str], None] = lambda line: None) -> None:
        self.model = model  # closed while unloaded
        self.n_parallel, self.n_chunk, self.unified = n_parallel, n_chunk, unified
        self.context_shift = context_shift  # --context-shift: the tokens kept (--keep); None: off
        # --cache-ram: slots' caches kept in host memory (None: off); --cache-idle-slots: the idle slots' caches go
        # there when a request starts (and, with -kvu, are dropped from the slots)
        self.cache, self.cache_idle_slots, self.log = cache, cache_idle_slots and cache is not None, log
        self.slots: Any = self._slots(model)  # Slots; None while unloaded
        self.n_slots, self.n_ctx_slot = self.slots.n_slots, self.slots.n_ctx_slot
        self.totals_before: dict[str, float] = {}  # the slots' totals of the models unloaded before
        # LoRA adapters: {id, path, alpha, n_weights, scale} each; the scales of requests that give none (POST
        # /lora-adapters sets them) and those applied on the model's context now
        self.lora_adapters = model.lora_adapters
        self.n_lora = len(self.lora_adapters)
        self.lora_scales = [a["scale"] for a in self.lora_adapters]
        self.lora_applied = list(self.lora_scales)
        self.max_queue = max_queue
        self.waiting: deque[Job] = deque()
        self.running: dict[int, Job] = {}
        self.cond = threading.Condition()
        self.stopping = False
        self.metrics = dict(prompt_tokens=0, prompt_cached=0, prompt_ms=0.0, predicted_tokens=0, predicted_decoded=0,
                            predicted_ms=0.0, tokens_max=0, embed_passes=0, requests_ok=0, requests_error=0,
                            requests_cancelled=0, requests_refused=0, spec_steps=0, spec_tokens=0, spec_drafted=0,
                            spec_accepted=0, exit_steps=0, exit_exits=0)
        # what /metrics' rate gauges average over: the tokens and times since the last scrape (as llama.cpp's buckets)
        self.bucket = dict(prompt_tokens=0, prompt_ms=0.0, predicted_decoded=0, predicted_ms=0.0)
        self.thread = threading.Thread(target=self._run, name="specee-slots", daemon=True)

    def _slots(self, model: Model) -> Any:
        slots = model.slots(self.n_parallel, self.n_chunk)
        if self.unified:  # --kv-unified: every slot may use the whole cache
            slots.set_unified()
        if self.context_shift is not None:  # a generation that fills its slot goes on, --keep tokens kept
            slots.set_context_shift(True, self.context_shift)
        return slots

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout=30)

    def totals(self) -> dict[str, float]:
        """The slots' totals (requests, passes, tokens, time) since the server started, across unloads."""
        now = self.slots.totals() if self.slots is not None else {}
        return {k: self.totals_before.get(k, 0) + now.get(k, 0) for k in {*self.totals_before, *now}}

    def unload(self) -> None:
        """Close the slots and the model (their memory is freed); the caller holds `cond` and nothing runs or waits."""
        assert not self.running and not self.waiting and self.slots is not None
        self.totals_before = self.totals()
        if self.cache is not None:  # its bytes are the model's cells: freed with them
            self.cache.clear()
        self.slots.close("the model is unloaded")
        self.model.close()
        self.slots = None

    def load(self, model: Model) -> None:
        """Serve `model` (the same file, options and slots as before `unload`)."""
        with self.cond:
            self.model, self.slots = model, self._slots(model)
            self.lora_applied = [a["scale"] for a in model.lora_adapters]

    def submit(self, job: Job) -> None:
        with self.cond:
            if len(self.waiting) >= self.max_queue:
                self.metrics["requests_refused"] += 1
                raise ApiError(503, f"the server is busy: {len(self.waiting)} requests wait for a slot", "server_error",
                               headers={"Retry-After": "1"})
            self.waiting.append(job)
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone (or a stop string ended it): its slot is freed before the next pass."""
        with self.cond:
            job.cancelled = True
            self.cond.notify()

    def set_lora_scales(self, scales: dict[int, float]) -> None:
        """POST /lora-adapters: the scales of the requests that give none from now on (adapters not listed: 0)."""
        with self.cond:
            self.lora_scales = [scales.get(i, 0.0) for i in range(self.n_lora)]

    # -- the batching thread

    def _lora_ready(self, job: Job) -> bool:
        """Whether the job can run under the scales applied now: they are its own, or nothing runs and its scales are
        applied (every slot's cache and the prompt cache emptied: their K/V are the old scales')."""
        lora = job.params.lora
        want = list(self.lora_scales) if lora is None else [lora.get(i, 0.0) for i in range(self.n_lora)]
        if want == self.lora_applied:
            return True
        if self.running:
            return False
        for slot in range(self.n_slots):
            self.slots.erase(slot)
        if self.cache is not None:
            self.cache.clear()
        self.model.set_lora(want)
        self.lora_applied = want
        self.log(f"srv  lora: scales {want} applied; the slots' caches are cleared")
        return True

    def _admit(self) -> None:
        """Waiting jobs onto free slots, in order; a job asking for a slot (id_slot) that is busy waits for it while
        the jobs behind it go on; a job under other LoRA scales than the running ones waits, and those behind it."""
        for job in list(self.waiting):
            if job.cancelled:
                self.waiting.remove(job)
                continue
            if not self._lora_ready(job):
                return
            p = job.params
            try:
                want = None if p.id_slot < 0 else p.id_slot
                if self.cache is not None and (want is None or want not in self.running):
                    want = self._from_cache(job.tokens, want)
                slot = self.slots.submit_options(job.tokens, p.options, p.n_predict, p.n_probs, want)
            except Exception as e:  # a bad prompt, options or slot: the request's 400, never the thread's end
                self.waiting.remove(job)
                self.metrics["requests_error"] += 1
                job.send("error", str(e), 400)
                continue
            if slot is None:
                if p.id_slot >= 0:
                    continue
                return
            self.waiting.remove(job)
            if p.post_sampling and p.n_probs >= 0:
                self.slots.set_post_sampling_probs(slot, True)
            job.slot = slot
            job.admitted = time.perf_counter()
            job.cached = self.slots.n_past(slot)
            self.running[slot] = job
            job.send("start", self.slots.mode(slot), slot)
            self._progress(job)

    def _keep(self, slot: int, tokens: list[int]) -> bool:
        """A free slot's cache into the prompt cache, unless an entry holds it already or it is over the limit."""
        assert self.cache is not None
        if not tokens or self.cache.holds(tokens):
            return False
        data = self.slots.save_mem(slot)
        self.log(f"srv  prompt_save: saving prompt with length {len(tokens)}, total state size = "
                 f"{len(data) / 1048576:.3f} MiB")
        if not self.cache.fits(len(data)):
            self.log(" - prompt state size exceeds cache size limit, skipping")
            return False
        self.cache.put(tokens, data)
        return True

    def _from_cache(self, prompt: list[int], slot: int | None) -> int | None:
        """llama.cpp's prompt cache at a request's start: the slot it will take (`slot`, or the one submit would
        choose; None: every slot is busy); the other free slots' caches kept (--cache-idle-slots), and when the slot
        would lose most of its cache, that cache kept and the entry sharing the longest prefix with the prompt
        restored into it."""
        assert self.cache is not None
        if slot is None:
            got = self.slots.choose(prompt)
            if got is None:
                return None
            slot = got[0]
        elif not 0 <= slot < self.n_slots:
            return slot  # submit says why
        if self.cache_idle_slots:
            for other in range(self.n_slots):
                if other != slot and other not in self.running:
                    self.log(f"slot {other}: saving idle slot to prompt cache")
                    if self._keep(other, self.slots.cache_tokens(other)):
                        self.log(f"slot {other}: __TEST_TAG_CACHE_IDLE_SLOT__")
                    if self.unified:  # the running request may need their cells
                        self.slots.erase(other)
        held = self.slots.cache_tokens(slot)
        cached = common_prefix(held, prompt)
        if held and cached >= len(held) / 2:
            return slot  # the slot keeps most of its cache
        self.log("srv  get_availabl: updating prompt cache")
        self._keep(slot, held)
        entry = self.cache.take(prompt, cached, len(held))
        if entry is not None:
            try:
                self.slots.restore_mem(slot, entry.data)
            except _core.SpecEEError as e:
                self.log(f"slot {slot}: failed to load prompt from cache: {e}")
                self.slots.erase(slot)
        return slot

    def _progress(self, job: Job) -> None:
        """llama.cpp's return_progress: the job's prompt tokens in its slot's cache, sent when they changed (the
        first at its admission: what its slot's cache held), until the whole prompt is in."""
        if not job.params.progress or job.processed >= len(job.tokens) or job.slot is None:
            return
        processed = self.slots.n_past(job.slot)
        if processed > job.processed:
            job.processed = processed
            ms = 0.0 if processed == job.cached else 1e3 * (time.perf_counter() - job.admitted)
            job.send("progress", job.cached, processed, ms)

    def _drop_cancelled(self) -> None:
        for slot, job in list(self.running.items()):
            if job.cancelled:
                self.slots.release(slot)
                del self.running[slot]
                self.metrics["requests_cancelled"] += 1

    def _deliver(self) -> None:
        self._drop_cancelled()
        for slot, job in list(self.running.items()):
            self._progress(job)
            out = self.slots.read(slot)
            if job.budget is not None and out.tokens and self._budget(slot, job, out.tokens, out.logprobs):
                continue
            if out.tokens:
                job.send("tokens", out.tokens, out.logprobs, self._stats(job, slot) if job.params.timings else None)
            if out.finish is not None:
                stats = self._stats(job, slot)
                self._count(stats, self.slots.mode(slot))
                self.slots.release(slot)
                del self.running[slot]
                self.metrics["requests_ok" if out.finish != "error" else "requests_error"] += 1
                job.send("done", out.finish, out.error, stats)

    def _stats(self, job: Job, slot: int) -> dict[str, float]:
        """The job's stats: its slot's (with its context shifts), after those of its runs before a thinking budget's
        cut."""
        now = {**self.slots.stats(slot), "n_shifted": self.slots.n_shifted(slot)}
        if job.stats_before is None:
            return now
        st = {k: job.stats_before.get(k, 0) + v for k, v in now.items()}
        for k in ("n_prompt", "n_reused", "t_prompt_ms"):  # the request's prompt is the first run's
            st[k] = job.stats_before[k]
        st["t_decode_ms"] += now["t_prompt_ms"]  # the forced tokens' pass is a decoding step
        steps = st.get("n_steps", 0)
        if steps:
            st["mean_accepted_tokens"] = st["n_decoded"] / steps
            st["exit_ratio"] = st["n_exits"] / steps
            st["mean_layers_run"] = st["n_layers_run"] / steps
        return st

    def _budget(self, slot: int, job: Job, tokens: list[int], logprobs: Any) -> bool:
        """A job's thinking budget spent by these tokens: the thought is cut after its n-th token, the forced tokens
        (the closing tag, ...) are given out after it, and the job goes on on the same slot with all of them as its
        prompt (the slot's cache holds all but the forced ones). False where the budget lets the tokens be."""
        assert job.budget is not None
        keep = job.budget.cut([self.model.token_to_piece(t) for t in tokens])
        if keep is None:
            job.generated += tokens
            return False
        p, forced = job.params, job.budget.forced
        left = -1 if p.n_predict < 0 else p.n_predict - len(job.generated) - keep
        if left >= 0:
            forced = forced[:left]
        given = tokens[:keep] + forced
        job.generated += given
        stats = self._stats(job, slot)
        stats["n_tokens"] += len(forced)
        self.slots.release(slot)
        del self.running[slot]
        job.stats_before = stats
        probs = list(logprobs[:keep]) + ([[(t, 0.0)] for t in forced] if p.n_probs >= 0 else [])
        job.send("tokens", given, probs, stats if p.timings else None)
        prompt = job.tokens + job.generated
        left = -1 if p.n_predict < 0 else p.n_predict - len(job.generated)
        if left == 0 or len(prompt) >= self.n_ctx_slot:  # nothing more to generate: the forced tokens end it
            self._count(stats, self.slots.mode(slot))
            self.metrics["requests_ok"] += 1
            job.send("done", "length", None, stats)
            return True
        try:
            again = self.slots.submit_options(prompt, p.options, left, p.n_probs, slot)
        except Exception as e:  # a request that started cannot fail here, but whatever did is its error, not ours
            self.metrics["requests_error"] += 1
            job.send("done", "error", str(e), stats)
            return True
        assert again == slot  # just released
        if p.post_sampling and p.n_probs >= 0:
            self.slots.set_post_sampling_probs(slot, True)
        self.running[slot] = job
        return True

    def _count(self, st: dict[str, float], mode: str) -> None:
        m = self.metrics
        for d in (m, self.bucket):
            d["prompt_tokens"] += int(st["n_prompt"])
            d["prompt_ms"] += st["t_prompt_ms"]
            d["predicted_decoded"] += int(st["n_decoded"])
            d["predicted_ms"] += st["t_decode_ms"]
        m["prompt_cached"] += int(st["n_reused"])
        m["predicted_tokens"] += int(st["n_tokens"])
        m["tokens_max"] = max(m["tokens_max"], int(st["n_prompt"] + st["n_reused"] + st["n_tokens"]))
        m["spec_drafted"] += int(st["n_drafted"])
        m["spec_accepted"] += int(st["n_accepted"])
        if MODES[mode].tree:
            m["spec_steps"] += int(st["n_steps"])
            m["spec_tokens"] += int(st["n_decoded"])
        if MODES[mode].exits:
            m["exit_steps"] += int(st["n_steps"])
            m["exit_exits"] += int(st["n_exits"])

    def _fail_running(self, message: str) -> None:
        """A pass failed: every running request gets the server's error (500)."""
        with self.cond:
            for slot, job in self.running.items():
                self.slots.release(slot)
                job.send("error", message, 500)
            self.running.clear()

    def _run(self) -> None:
        while not self.stopping:
            try:
                self._pass()
            except Exception as e:  # whatever failed, the requests on the slots get it and the loop goes on
                self._fail_running(f"internal error: {e}")

    def _pass(self) -> None:
        """Admit waiting requests, run one pass, hand out its tokens."""
        with self.cond:
            while not self.stopping and not self.waiting and not self.running:
                self.cond.wait(timeout=1.0)
            if self.stopping:
                return
            self._drop_cancelled()  # before the next pass
            self._admit()
        if self.running:
            try:
                self.slots.step()  # the GIL is released for the pass
            except _core.SpecEEError as e:
                # llama.cpp's words for a shared cache (--kv-unified) that the running requests overflowed
                overflow = "context overflow" in str(e)
                self._fail_running(f"context size has been exceeded: {e}" if overflow else str(e))
        with self.cond:
            self._deliver()


@dataclass
class ServerState:
    """What the endpoints share: the model, the engine, the model's name in the API, the mode of requests that name
    none, the API key (None: none needed), whether /metrics is served, the most tokens a request that names none
    generates (-n; -1: until an end-of-generation token or a full slot), the sampling defaults of requests
    (GenerateOptions' fields, from --temp, --seed, ...), whether /slots is served, the model's names (-a a,b: `alias`
    the first) and tags (--tags), the origins CORS lets a browser call from, the chat template, the model's facts
    /v1/models shows, whether the model is unloaded for now, the folder of saved slots, the pooling of
    embeddings, and /infill's settings."""

    model: Model
    engine: Engine
    alias: str
    mode: str
    api_key: str | None
    metrics: bool
    n_predict: int = -1
    sampling: dict[str, Any] = field(default_factory=dict)
    slots: bool = True
    aliases: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    cors_origins: list[str] = field(default_factory=lambda: ["*"])
    created: int = field(default_factory=lambda: int(time.time()))
    template: ChatTemplate | None = None  # how chats become prompts (server/templates.py)
    verbose: bool = False  # --verbose: OpenAI-shaped responses carry llama.cpp's __verbose (what /completion answers)
    model_meta: dict[str, Any] = field(default_factory=dict)  # /v1/models' meta, kept while the model sleeps
    sleeping: bool = False  # the model is unloaded for now (--sleep-idle-seconds, server/sleep.py)
    slot_save_path: str | None = None  # --slot-save-path: where POST /slots/{id}?action=save writes (None: not served)
    pooling: str = "mean"  # of embeddings (--pooling; --reranking: rank, /rerank), a name of specee.pooling
    embd_normalize: int = 2  # how pooled embeddings are scaled (--embd-normalize; server/embed.py `normalized`)
    # the logical batch (-b; the context options' default): /infill shares the context by it (server/infill.py)
    n_batch: int = int(CONTEXT_OPTIONS["n_batch"]["default"])
    spm_infill: bool = False  # --spm-infill: /infill puts the suffix before the prefix
