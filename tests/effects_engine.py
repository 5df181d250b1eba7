"""Probes of the keys the engine reads: ``[model]``, ``[scheduler]``, ``[speculative]``, ``[sliding_window]``,
``[server] engine_process`` and the built-in components' ``[plugins.NAME]`` tables."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import pytest

from tests.effects_lab import Lab, greedy, run
from tierserve.models.builtin_models import write_checkpoint
from tierserve.engine import RequestError
from tierserve.core.errors import ConfigError
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.scheduler import QueueFullError

LONG = "Once upon a time, in a kingdom by the sea, there lived a princess who loved to read books."


# ---- [model] ---------------------------------------------------------------------------------


def model_path(lab: Lab) -> None:
    other = write_checkpoint(lab.tmp / "other", "llama", seed=2)
    with lab.engine({"model.path": str(other)}) as engine:
        assert engine.info.path == str(other)
        assert run(engine, LONG, greedy(8)).token_ids != run(lab.shared, LONG, greedy(8)).token_ids


def model_gguf_file(lab: Lab) -> None:
    from tests.gguf_helpers import write_gguf

    folder = lab.tmp / "ggufs"
    folder.mkdir()
    write_gguf(lab.checkpoint, folder / "model-f32.gguf", "f32")
    with lab.engine({"model.path": str(folder), "model.gguf_file": "model-f32.gguf"}) as engine:
        assert engine.info.path == str(folder / "model-f32.gguf")
        assert run(engine, LONG, greedy(8)).token_ids == run(lab.shared, LONG, greedy(8)).token_ids
    with pytest.raises(ConfigError, match=r"model.gguf_file = 'missing.gguf': no such file .* GGUF files there: model-f32.gguf"):
        with lab.engine({"model.path": str(folder), "model.gguf_file": "missing.gguf"}):
            pass


def model_backend(lab: Lab) -> None:
    assert lab.shared.info.backend == "native"  # auto, for a Llama checkpoint
    with lab.engine({"model.backend": "transformers"}) as engine:
        assert (engine.info.backend, engine.info.paged) == ("transformers", True)
        assert engine.info.tier_names == lab.shared.info.tier_names
        assert run(engine, LONG).token_ids == run(lab.shared, LONG).token_ids  # the same model, run another way
    with lab.engine({"model.backend": "transformers-unpaged"}) as engine:
        assert (engine.info.backend, engine.info.paged, engine.info.tier_names) == ("transformers-unpaged", False, ())
        assert run(engine, LONG).token_ids == run(lab.shared, LONG).token_ids


def model_dtype(lab: Lab) -> None:
    with lab.engine({"model.dtype": "bfloat16"}) as engine:
        assert engine.info.dtype == "bfloat16"
        assert engine.info.kv_block_bytes * 2 == lab.shared.info.kv_block_bytes


def model_quantization(lab: Lab) -> None:
    with lab.engine({"model.quantization": "int8"}) as engine:
        assert (engine.info.quantization, engine.info.linear_kernel[:5]) == ("int8", "int8-")
        assert engine.info.fingerprint != lab.shared.info.fingerprint  # int8 KV is never served to float32
        assert len(run(engine, LONG, greedy(8)).token_ids) == 8
    with lab.engine({"model.quantization": "int8", "model.backend": "transformers"}) as engine:
        assert (engine.info.quantization, engine.info.linear_kernel[:5]) == ("int8", "int8-")
        assert len(run(engine, LONG, greedy(8)).token_ids) == 8
    with pytest.raises(ConfigError, match=r"model.quantization = 'int8' is supported by the native backend only"):
        with lab.engine({"model.quantization": "int8", "model.backend": "transformers-unpaged"}):
            pass


def model_device(lab: Lab) -> None:
    import torch

    if torch.cuda.is_available():
        with lab.engine({"model.device": "cuda:0"}) as engine:
            assert engine.info.device == "cuda:0"
        return
    with pytest.raises(ConfigError, match=r"model.device = 'cuda:0' but CUDA is not available here"):
        with lab.engine({"model.device": "cuda:0"}):
            pass


def model_max_model_len(lab: Lab) -> None:
    with lab.engine({"model.max_model_len": 24}) as engine:
        assert engine.info.max_model_len == 24
        with pytest.raises(RequestError, match=r"context length \(24\)"):
            run(engine, LONG)
    trained = lab.shared.info.max_model_len
    with pytest.raises(ConfigError, match=rf"model.max_model_len = {trained + 1} is longer than .* allows \({trained} "):
        with lab.engine({"model.max_model_len": trained + 1}):
            pass


def model_seed(lab: Lab) -> None:
    sampled = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)  # no seed of its own
    outputs = []
    for seed in (7, 7, 8):
        with lab.engine({"model.seed": seed}) as engine:
            outputs.append(run(engine, LONG, sampled).token_ids)
    assert outputs[0] == outputs[1] != outputs[2]


# ---- [scheduler] -----------------------------------------------------------------------------


def first_finished(lab: Lab, values: dict) -> str:
    """Submit "later" (priority 5) and then "sooner" (priority 0) to one sequence slot; which finishes first."""
    with lab.engine(values) as engine:
        for name, priority in (("later", 5), ("sooner", 0)):
            engine.submit(engine.encode_prompt(LONG), greedy(2), request_id=name, priority=priority)
        while len(engine.in_flight()) == 2:
            engine.step()
        [left] = engine.in_flight()
        return "sooner" if left == "later" else "later"


def scheduler_name(lab: Lab) -> None:
    assert first_finished(lab, {"scheduler.max_num_seqs": 1}) == "later"  # fcfs: arrival order
    assert first_finished(lab, {"scheduler.max_num_seqs": 1, "scheduler.name": "priority"}) == "sooner"


def scheduler_max_num_seqs(lab: Lab) -> None:
    with lab.engine({"scheduler.max_num_seqs": 1}) as engine:
        for prompt in ("a", "b", "c"):
            engine.submit(engine.encode_prompt(prompt), greedy())
        engine.step()
        stats = engine.stats()
        assert (stats.requests_running, stats.requests_waiting) == (1, 2)


def scheduler_max_num_batched_tokens(lab: Lab) -> None:
    prompt_tokens = len(lab.shared.encode_prompt(LONG))
    with lab.engine({"scheduler.max_num_batched_tokens": 8}) as engine:
        run(engine, LONG, greedy(1))
        assert engine.stats().counters.steps == -(-prompt_tokens // 8)  # the prompt in chunks of 8
    before = lab.shared.stats().counters.steps
    run(lab.shared, LONG, greedy(1))
    assert lab.shared.stats().counters.steps == before + 1


def scheduler_prefill_group_tokens(lab: Lab) -> None:
    for limit, running in ((1, 1), (0, 3)):  # one prompt a step, or all three together
        with lab.engine({"scheduler.prefill_group_tokens": limit}) as engine:
            for prompt in ("a b c", "d e f", "g h i"):
                engine.submit(engine.encode_prompt(prompt), greedy())
            engine.step()
            stats = engine.stats()
            assert (stats.requests_running, stats.requests_waiting) == (running, 3 - running)


def scheduler_decode_steps_between_prefills(lab: Lab) -> None:
    for steps, running_after_one_step in ((1, 1), (0, 2)):  # the second prompt waits a step, or starts at once
        with lab.engine({"scheduler.decode_steps_between_prefills": steps}) as engine:
            engine.submit(engine.encode_prompt("a b c"), greedy(8))
            engine.step()  # the first prompt; it now decodes
            engine.submit(engine.encode_prompt("d e f"), greedy(8))
            engine.step()
            stats = engine.stats()
            assert (stats.requests_running, stats.requests_waiting) == (running_after_one_step, 2 - running_after_one_step)


def scheduler_max_waiting_requests(lab: Lab) -> None:
    with lab.engine({"scheduler.max_waiting_requests": 2}) as engine:
        ids = engine.encode_prompt("a")
        engine.submit(ids, greedy())
        engine.submit(ids, greedy())
        with pytest.raises(QueueFullError, match=r"max_waiting_requests = 2"):
            engine.submit(ids, greedy())


# ---- [speculative] ---------------------------------------------------------------------------


def drafts(lab: Lab, values: dict, draft: Path | None = None) -> tuple[int, int]:
    """(draft tokens proposed, verifications) over one greedy request, drafted by ``draft``
    (default: the target checkpoint itself, whose every draft is accepted)."""
    drafting = {"speculative.method": "draft_model", "plugins.draft_model.path": str(draft or lab.checkpoint)}
    with lab.engine({**drafting, **values}) as engine:
        run(engine, LONG, greedy(16))
        speculation = engine.stats().speculation
        return speculation.proposed, speculation.verifications


def speculative_method(lab: Lab) -> None:
    with lab.engine({"speculative.method": "ngram"}) as engine:
        assert engine.info.speculator == "ngram"
    values = {"speculative.method": "draft_model", "plugins.draft_model.path": str(lab.checkpoint)}
    with lab.engine(values) as engine:
        assert engine.info.speculator == "draft_model"
        assert run(engine, LONG, greedy(12)).token_ids == run(lab.shared, LONG, greedy(12)).token_ids
        assert engine.stats().speculation.verifications > 0
    assert lab.shared.stats().speculation.proposed == 0


def speculative_num_speculative_tokens(lab: Lab) -> None:
    one, one_checks = drafts(lab, {"speculative.num_speculative_tokens": 1})
    assert one == one_checks > 0  # one draft per verification
    four, four_checks = drafts(lab, {})
    assert four > 3 * four_checks  # four per verification, but near the end


def speculative_adaptive(lab: Lab) -> None:
    other = write_checkpoint(lab.tmp / "other", "llama", seed=2)  # a draft model that is mostly wrong
    adaptive, adaptive_checks = drafts(lab, {}, other)
    fixed, fixed_checks = drafts(lab, {"speculative.adaptive": False}, other)
    assert fixed > 3 * fixed_checks  # always four
    assert adaptive < 2 * adaptive_checks  # down to one after each rejection


def tree_speculation(lab: Lab, values: dict) -> object:
    """The speculation snapshot after one greedy request drafted by token trees (ngram_tree unless ``values``
    names another method), on a prompt that repeats itself."""
    with lab.engine({"speculative.method": "ngram_tree", **values}) as engine:
        assert run(engine, LONG + " " + LONG, greedy(24)).token_ids == run(lab.shared, LONG + " " + LONG, greedy(24)).token_ids
        return engine.stats().speculation


def speculative_max_tree_nodes(lab: Lab) -> None:
    wide = lab.once("trees-default", lambda: tree_speculation(lab, {}))
    assert wide.tree_nodes_per_step > 2
    assert tree_speculation(lab, {"speculative.max_tree_nodes": 2}).tree_nodes_per_step <= 2


def speculative_step_tree_nodes(lab: Lab) -> None:
    wide = lab.once("trees-default", lambda: tree_speculation(lab, {}))
    assert wide.tree_nodes_per_step > 1
    assert tree_speculation(lab, {"speculative.step_tree_nodes": 1}).tree_nodes_per_step == 1


# ---- [sliding_window] ------------------------------------------------------------------------

SMALL_WINDOW = {"kv_cache.block_size": 4, "sliding_window.window_size": 16, "sliding_window.window_overlap": 4}


def window_stats(values: dict, lab: Lab):
    """The sliding-window statistics after one generation of 32 tokens in streaming mode."""

    def generate():
        with lab.engine({"sliding_window.enabled": True, **SMALL_WINDOW, **values}) as engine:
            run(engine, "Hello there", greedy(32))
            return engine.stats().sliding_window

    return lab.once(("window", tuple(sorted(values.items()))), generate)


def sliding_window_enabled(lab: Lab) -> None:
    limited = {"model.max_model_len": 32, "kv_cache.block_size": 4}
    with lab.engine(limited) as engine, pytest.raises(RequestError, match="context length"):
        run(engine, "Hello there", greedy(48))
    with lab.engine({**limited, "sliding_window.enabled": True, "sliding_window.window_size": 16,
                     "sliding_window.window_overlap": 4}) as engine:  # fmt: skip
        assert len(run(engine, "Hello there", greedy(48)).token_ids) == 48  # streams past the context
        assert engine.stats().sliding_window.enabled and engine.stats().sliding_window.windows_slid > 0


def sliding_window_allow_per_request(lab: Lab) -> None:
    ids = lab.shared.encode_prompt("Hello there")
    with lab.engine({"sliding_window.allow_per_request": False}) as engine:
        with pytest.raises(RequestError, match="allow_per_request"):  # off: a request may not turn the window on
            engine.submit(ids, greedy(4), sliding_window=True)
    limited = {"model.max_model_len": 32, **SMALL_WINDOW}
    with lab.engine({**limited, "sliding_window.allow_per_request": True}) as engine:
        _, stream = engine.submit(ids, greedy(48), sliding_window=True)
        tokens = 0
        while not (output := engine.next_output(stream)).finished:
            tokens += len(output.token_ids)
        assert tokens + len(output.token_ids) == 48  # that request streams past the context
        with pytest.raises(RequestError, match="context length"):  # the others do not
            run(engine, "Hello there", greedy(48))


def sliding_window_window_size(lab: Lab) -> None:
    assert window_stats({}, lab).tokens_dropped > window_stats({"sliding_window.window_size": 24}, lab).tokens_dropped


def sliding_window_window_overlap(lab: Lab) -> None:
    assert window_stats({}, lab).windows_slid > window_stats({"sliding_window.window_overlap": 12}, lab).windows_slid


def sliding_window_sink_tokens(lab: Lab) -> None:
    kept = window_stats({"sliding_window.sink_tokens": 8}, lab)
    assert kept.tokens_dropped < window_stats({}, lab).tokens_dropped


def sliding_window_use_flash_attention(lab: Lab) -> None:
    with lab.engine({"sliding_window.use_flash_attention": False}) as engine:
        assert engine.info.attention_kernel == "math"
        assert lab.shared.info.attention_kernel.endswith("(torch picks)")
        assert engine.info.fingerprint != lab.shared.info.fingerprint  # KV of one kernel is never served to the other
        assert run(engine, LONG, greedy(8)).token_ids == run(lab.shared, LONG, greedy(8)).token_ids


# ---- [server] engine_process -----------------------------------------------------------------


def server_engine_process(lab: Lab) -> None:
    loaded = lab.settings({"server.engine_process": False})
    children = set(multiprocessing.active_children())
    from tierserve.engine import EngineClient

    engine = EngineClient.from_settings(loaded.settings, loaded.plugins)  # where the settings say
    try:
        engine.start()
        assert set(multiprocessing.active_children()) == children
        assert any(t.name == "tierserve-engine" for t in threading.enumerate())  # a thread of this process
        assert run(engine, "Hello").finish_reason == "length"
    finally:
        engine.close()


# ---- [plugins.NAME] of built-in components ---------------------------------------------------


def ngram_drafts(lab: Lab, values: dict, history: list[int]) -> list[int]:
    """What the ngram speculator the settings build proposes after ``history``."""
    from tierserve.core.sequence import Sequence
    from tierserve.core.speculation import DraftRequest

    loaded = lab.settings({"speculative.method": "ngram", **values})
    speculator = loaded.plugins.registry("speculators").get("ngram").factory(loaded.settings, None)
    seq = Sequence(seq_id=0, request_id="r", token_ids=list(history), num_prompt_tokens=len(history), params=greedy())
    [proposal] = speculator.propose([DraftRequest(seq, history, 3)])
    return list(proposal.token_ids)


def plugins_ngram_min_n(lab: Lab) -> None:
    history = [5, 6, 9, 9, 7, 6]  # only the last token, 6, occurred before (followed by 9)
    assert ngram_drafts(lab, {}, history) == [9, 9, 7]
    assert ngram_drafts(lab, {"plugins.ngram.min_n": 2}, history) == []


def plugins_ngram_max_n(lab: Lab) -> None:
    history = [1, 2, 3, 4, 8, 3, 4, 5, 9, 2, 3, 4]  # "2 3 4" was followed by 8, the later "3 4" by 5
    assert ngram_drafts(lab, {}, history) == [8, 3, 4]
    assert ngram_drafts(lab, {"plugins.ngram.max_n": 2}, history) == [5, 9, 2]


def tree_drafts(lab: Lab, values: dict, history: list[int], nodes: int = 16) -> list[tuple[int, int]]:
    """(token, parent's token or None) of each node the ngram_tree speculator the settings build proposes."""
    from tierserve.core.sequence import Sequence
    from tierserve.core.speculation import DraftRequest

    loaded = lab.settings({"speculative.method": "ngram_tree", **values})
    speculator = loaded.plugins.registry("speculators").get("ngram_tree").factory(loaded.settings, None)
    seq = Sequence(seq_id=0, request_id="r", token_ids=list(history), num_prompt_tokens=len(history), params=greedy())
    [tree] = speculator.propose([DraftRequest(seq, history, nodes, 64)])
    return [(t, tree.token_ids[p] if p >= 0 else None) for t, p in zip(tree.token_ids, tree.parents or [])]


def plugins_ngram_tree_min_n(lab: Lab) -> None:
    history = [5, 6, 9, 9, 7, 6]  # only the last token, 6, occurred before (followed by 9)
    assert tree_drafts(lab, {}, history)[0] == (9, None)
    assert tree_drafts(lab, {"plugins.ngram_tree.min_n": 2}, history) == []


def plugins_ngram_tree_max_n(lab: Lab) -> None:
    history = [1, 2, 3, 4, 8, 3, 4, 5, 9, 2, 3, 4]  # "2 3 4" was followed by 8, the later "3 4" by 5
    assert tree_drafts(lab, {}, history)[0] == (8, None)  # the longer match weighs more
    assert tree_drafts(lab, {"plugins.ngram_tree.max_n": 2}, history)[0] == (5, None)


def plugins_ngram_tree_max_matches(lab: Lab) -> None:
    history = [7, 1, 7, 2, 7, 3, 7]  # 7 was followed by 1, 2 and 3
    roots = lambda values: {t for t, parent in tree_drafts(lab, values, history) if parent is None}  # noqa: E731
    assert roots({}) == {1, 2, 3}
    assert roots({"plugins.ngram_tree.max_matches": 1}) == {3}  # the most recent match only


def plugins_ngram_tree_max_depth(lab: Lab) -> None:
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]
    assert len(tree_drafts(lab, {}, history, nodes=32)) == 16  # one path, as deep as the default max_depth
    assert tree_drafts(lab, {"plugins.ngram_tree.max_depth": 2}, history) == [(2, None), (3, 2)]


def medusa_heads(lab: Lab) -> Path:
    from tests.tree_helpers import write_medusa_heads

    return lab.once("medusa-heads", lambda: write_medusa_heads(lab.tmp / "medusa", lab.checkpoint))


def plugins_medusa_path(lab: Lab) -> None:
    with pytest.raises(ConfigError, match=r"plugins.medusa.path: set it to a Medusa checkpoint"):
        with lab.engine({"speculative.method": "medusa"}):
            pass
    speculation = tree_speculation(lab, {"speculative.method": "medusa", "plugins.medusa.path": str(medusa_heads(lab))})
    assert speculation.method == "medusa" and speculation.tree_verifications > 0


def plugins_medusa_choices(lab: Lab) -> None:
    values = {"speculative.method": "medusa", "plugins.medusa.path": str(medusa_heads(lab))}
    assert tree_speculation(lab, values).tree_nodes_per_step > 4
    chain = tree_speculation(lab, {**values, "plugins.medusa.choices": [[0], [0, 0]]})
    assert chain.tree_nodes_per_step <= 2 and chain.avg_depth <= 2


def plugins_draft_model_path(lab: Lab) -> None:
    with pytest.raises(ConfigError, match=r"plugins.draft_model.path .*set it to a checkpoint directory"):
        with lab.engine({"speculative.method": "draft_model"}):
            pass
    values = {"speculative.method": "draft_model", "plugins.draft_model.path": str(lab.checkpoint)}
    with lab.engine(values) as engine:
        run(engine, LONG, greedy(8))
        speculation = engine.stats().speculation
        assert speculation.proposed > 0 and speculation.accepted == speculation.proposed  # it drafts with itself


def plugins_native_linear_kernel(lab: Lab) -> None:
    with lab.engine({"plugins.native.linear_kernel": "torch"}) as engine:
        torch_kernel = engine.info.fingerprint  # the kernel is part of it: KV of one is never served to the other
        assert run(engine, LONG, greedy(8)).token_ids == run(lab.shared, LONG, greedy(8)).token_ids
    try:
        with lab.engine({"plugins.native.linear_kernel": "onednn"}) as engine:
            assert engine.info.fingerprint != torch_kernel
    except ValueError as exc:  # a machine without oneDNN: refused, saying what is missing
        assert "'onednn' needs a CPU device and a PyTorch build with oneDNN" in str(exc)


def plugins_transformers_linear_kernel(lab: Lab) -> None:
    values = {"model.backend": "transformers"}
    with lab.engine(values | {"plugins.transformers.linear_kernel": "torch"}) as engine:
        assert engine.info.linear_kernel == "torch"
        torch_kernel = engine.info.fingerprint
        assert run(engine, LONG, greedy(8)).token_ids == run(lab.shared, LONG, greedy(8)).token_ids
    with lab.engine(values) as engine:  # auto: tierserve's float32 panels (AVX-512), else oneDNN where it runs
        assert engine.info.linear_kernel in ("f32-panels", "onednn", "torch")
        assert (engine.info.fingerprint == torch_kernel) == (engine.info.linear_kernel == "torch")
        assert run(engine, LONG, greedy(8)).token_ids == run(lab.shared, LONG, greedy(8)).token_ids


PROBES = {
    "model.path": model_path,
    "model.gguf_file": model_gguf_file,
    "model.backend": model_backend,
    "model.dtype": model_dtype,
    "model.quantization": model_quantization,
    "model.device": model_device,
    "model.max_model_len": model_max_model_len,
    "model.seed": model_seed,
    "scheduler.name": scheduler_name,
    "scheduler.max_num_seqs": scheduler_max_num_seqs,
    "scheduler.max_num_batched_tokens": scheduler_max_num_batched_tokens,
    "scheduler.max_waiting_requests": scheduler_max_waiting_requests,
    "scheduler.prefill_group_tokens": scheduler_prefill_group_tokens,
    "scheduler.decode_steps_between_prefills": scheduler_decode_steps_between_prefills,
    "speculative.method": speculative_method,
    "speculative.num_speculative_tokens": speculative_num_speculative_tokens,
    "speculative.adaptive": speculative_adaptive,
    "speculative.max_tree_nodes": speculative_max_tree_nodes,
    "speculative.step_tree_nodes": speculative_step_tree_nodes,
    "sliding_window.enabled": sliding_window_enabled,
    "sliding_window.allow_per_request": sliding_window_allow_per_request,
    "sliding_window.window_size": sliding_window_window_size,
    "sliding_window.window_overlap": sliding_window_window_overlap,
    "sliding_window.sink_tokens": sliding_window_sink_tokens,
    "sliding_window.use_flash_attention": sliding_window_use_flash_attention,
    "server.engine_process": server_engine_process,
    "plugins.ngram.min_n": plugins_ngram_min_n,
    "plugins.ngram_tree.min_n": plugins_ngram_tree_min_n,
    "plugins.ngram_tree.max_n": plugins_ngram_tree_max_n,
    "plugins.ngram_tree.max_matches": plugins_ngram_tree_max_matches,
    "plugins.ngram_tree.max_depth": plugins_ngram_tree_max_depth,
    "plugins.medusa.path": plugins_medusa_path,
    "plugins.medusa.choices": plugins_medusa_choices,
    "plugins.ngram.max_n": plugins_ngram_max_n,
    "plugins.draft_model.path": plugins_draft_model_path,
    "plugins.native.linear_kernel": plugins_native_linear_kernel,
    "plugins.transformers.linear_kernel": plugins_transformers_linear_kernel,
}
