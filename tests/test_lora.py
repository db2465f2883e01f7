"""Chapter 31: LoRA adapters (PEFT loading, the batched products, the engine).

The kernels run under TRITON_INTERPRET=1 on a CPU (conftest.py)."""

import json
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.lora.ops import LoRAMapping, SlotMapping, lora_expand_ref, lora_shrink_ref
from minillm.lora.peft import LoRAError, load_lora_adapter
from minillm.lora.request import LoRARequest

peft = pytest.importorskip("peft")


@settings(max_examples=25, deadline=None)
@given(
    slots=st.lists(st.integers(-1, 3), min_size=1, max_size=40),
    rank=st.sampled_from([1, 8, 16, 24]),
    n=st.sampled_from([8, 70]),
    k=st.sampled_from([40, 96, 200]),  # below, between and past BLOCK_K=64's tiles
)
def test_triton_kernels_match_reference_on_random_mixes(slots, rank, n, k):
    from minillm.kernels.lora import lora_expand_triton, lora_shrink_triton

    torch.manual_seed(len(slots) + rank)
    on = "cuda" if torch.cuda.is_available() else "cpu"  # Triton's interpreter on a CPU
    a, b = torch.randn(4, k, rank, device=on), torch.randn(4, rank, n, device=on)
    mapping = LoRAMapping.build(slots, device=on)
    x = torch.randn(len(slots), k, device=on)
    y0 = torch.randn(len(slots), n, device=on)
    buf_ref, buf = lora_shrink_ref(x, a, mapping), lora_shrink_triton(x, a, mapping)
    assert buf.shape[0] == -(-k // 64)  # K split in pieces of BLOCK_K (fewer than 8)
    adapted = torch.tensor(slots, device=on) >= 0  # the rows shrink writes
    torch.testing.assert_close(buf.sum(0)[adapted], buf_ref[adapted], rtol=1e-4,
                               atol=1e-4)  # fmt: skip
    y_ref, y = y0.clone(), y0.clone()
    lora_expand_ref(y_ref, buf_ref, b, mapping)
    lora_expand_triton(y, buf, b, mapping)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    for t, slot in enumerate(slots):  # the formula; base rows untouched
        want = y0[t] + (x[t] @ a[slot] @ b[slot] if slot >= 0 else 0)
        torch.testing.assert_close(y_ref[t], want, rtol=1e-4, atol=1e-4)
    # the engine's fixed buffers: as many tiles as build's, the rest empty; launched
    # as an eager step and as a graph captured for 64 rows (its bound, not the step's)
    fixed = SlotMapping(64, 4, device=on)
    assert fixed.fill(slots, [1] * len(slots)) == bool(adapted.any())
    assert fixed.token_slots[: len(slots)].tolist() == slots
    used = fixed.tiles[:, 1] < fixed.tiles[:, 2]
    assert (
        int(used.sum()) == len(mapping.tiles) and not used[len(mapping.tiles) :].any()
    )
    for extra in (0, 64 - len(slots)):
        buf = lora_shrink_triton(torch.cat([x, x.new_zeros(extra, k)]), a, fixed)
        torch.testing.assert_close(buf.sum(0)[: len(slots)][adapted], buf_ref[adapted],
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
        y = torch.cat([y0, y0.new_zeros(extra, n)])
        lora_expand_triton(y, buf, b, fixed)
        torch.testing.assert_close(y[: len(slots)], y_ref, rtol=1e-4, atol=1e-4)
        assert not y[len(slots) :].any()  # a graph's padding rows: untouched


def test_slot_mapping_groups_requests_by_slot_and_refuses_an_oversized_step():
    fixed = SlotMapping(40, 3)
    # requests' slots and token counts: slot 1 has 3 + 18 = 21 tokens, two tiles
    assert fixed.fill([1, -1, 0, 1], [3, 2, 1, 18])
    assert fixed.token_slots[:24].tolist() == [1] * 3 + [-1] * 2 + [0] + [1] * 18
    assert fixed.sorted_tokens[:22].tolist() == [5, 0, 1, 2, *range(6, 24)]
    tiles = [[0, 0, 1], [1, 1, 22], [1, 17, 22]]  # slot, first row, segment's end
    assert fixed.tiles.tolist() == tiles + [[0, 0, 0]] * 3  # 40/16 + 3 slots: 6
    x, a = torch.randn(24, 6), torch.randn(3, 6, 2)
    built = LoRAMapping.build(fixed.token_slots[:24].tolist())
    torch.testing.assert_close(
        lora_shrink_ref(x, a, fixed), lora_shrink_ref(x, a, built)
    )
    with pytest.raises(ValueError, match="41 tokens in a step; the mapping holds 40"):
        fixed.fill([0], [41])
    assert fixed.tiles.tolist() == tiles + [[0, 0, 0]] * 3  # refused: nothing changed
    assert not fixed.fill([-1], [4]) and not fixed.tiles.any()  # no adapted token


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="Triton 3.9's CPU interpreter misreads bfloat16 tensors (off by 1e10)",
)
def test_triton_kernels_in_bfloat16():
    from minillm.kernels.lora import lora_expand_triton, lora_shrink_triton

    torch.manual_seed(0)
    slots, (k, rank, n) = [2] * 5 + [-1] * 3 + [0, 3, 2, -1], (200, 16, 70)
    a, b = torch.randn(4, k, rank) / k**0.5, torch.randn(4, rank, n) / rank**0.5
    x, y0 = torch.randn(len(slots), k), torch.randn(len(slots), n)
    x, a, b, y0 = (t.cuda() for t in (x, a, b, y0))
    mapping = LoRAMapping.build(slots, device="cuda")
    buf_ref = lora_shrink_ref(x.bfloat16(), a.bfloat16(), mapping)
    y_ref = y0.bfloat16().float()
    lora_expand_ref(y_ref, buf_ref, b.bfloat16().float(), mapping)
    x, a, b, y = x.bfloat16(), a.bfloat16(), b.bfloat16(), y0.bfloat16()
    buf = lora_shrink_triton(x, a, mapping)  # float32 sums of bf16 products
    adapted = torch.tensor(slots, device="cuda") >= 0
    torch.testing.assert_close(buf.sum(0)[adapted], buf_ref[adapted], rtol=1e-4,
                               atol=1e-4)  # fmt: skip
    lora_expand_triton(y, buf, b, mapping)
    # expand rounds buf to bf16 and stores y in bf16: two roundings of 2**-8 each,
    # on values of size ~1 (the scaled A, B), so 2 * 2**-8 relative, 2**-6 absolute
    torch.testing.assert_close(y.float(), y_ref, rtol=2 * 2**-8, atol=2**-6)
    assert not torch.equal(y.float(), y0.bfloat16().float())  # the adapter added


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from minillm.tiny import tiny_model_path

    root = tmp_path_factory.mktemp("lora")
    mods = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for i, (r, targets) in enumerate([(8, mods), (4, ["q_proj", "v_proj"]), (8, mods)]):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_path(progress=False))
        config = peft.LoraConfig(
            r=r, lora_alpha=2 * r, target_modules=targets, use_rslora=i == 2
        )
        config.init_lora_weights = False  # random B: the adapter changes the output
        get_peft_model(base, config).save_pretrained(root / f"a{i}")
    return root


def _spoil_and_load(adapter_dirs, tmp_path, spoil, max_rank=16):
    from minillm.tiny import tiny_model

    bad = tmp_path / "bad"
    shutil.copytree(adapter_dirs / "a0", bad)
    spoil(bad)
    model, _ = tiny_model(progress=False)
    with pytest.raises(LoRAError) as e:
        load_lora_adapter(bad, model.config, max_rank)
    return str(e.value)


def test_bad_adapters_are_refused_by_name(adapter_dirs, tmp_path):
    def config(**kw):
        def spoil(f):
            p = f / "adapter_config.json"
            p.write_text(json.dumps({**json.loads(p.read_text()), **kw}))

        return spoil

    msg = _spoil_and_load(adapter_dirs, tmp_path, config(target_modules=["lm_head"]))
    assert "lm_head" in msg
    shutil.rmtree(tmp_path / "bad")
    msg = _spoil_and_load(adapter_dirs, tmp_path, lambda f: None, max_rank=4)
    assert "max_lora_rank=4" in msg
    shutil.rmtree(tmp_path / "bad")
    gone = _spoil_and_load(
        adapter_dirs, tmp_path, lambda f: (f / "adapter_model.safetensors").unlink()
    )
    assert "adapter_model.safetensors" in gone
    for spoil, words in [
        (lambda f: (f / "adapter_config.json").write_text("{r: 8"), "not JSON"),
        (config(r=None), "r=None"),
        (config(r="8"), "r='8'"),
        (config(lora_alpha="x"), "lora_alpha"),
        (_reshape_one, "has shape"),
        (lambda f: (f / "adapter_model.safetensors").write_text("x"), "cannot read"),
    ]:
        shutil.rmtree(tmp_path / "bad")
        assert words in _spoil_and_load(adapter_dirs, tmp_path, spoil)


def _reshape_one(folder):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "adapter_model.safetensors")
    key = next(k for k in tensors if "q_proj.lora_B" in k)
    tensors[key] = tensors[key][:-1]
    save_file(tensors, folder / "adapter_model.safetensors")


def _peft_greedy(adapter_dirs, names, prompt_ids, num_tokens):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from minillm.tiny import tiny_model_path

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path(progress=False))
    ref = PeftModel.from_pretrained(
        base, adapter_dirs / names[0], adapter_name=names[0]
    )
    for name in names[1:]:
        ref.load_adapter(adapter_dirs / name, adapter_name=name)
    out = {}
    for name in [None, *names]:
        for i, prompt in enumerate(prompt_ids):
            ids = torch.tensor([prompt])
            for _ in range(num_tokens):
                with torch.no_grad():
                    if name is None:
                        with ref.disable_adapter():
                            logits = ref(input_ids=ids).logits
                    else:
                        ref.set_adapter(name)
                        logits = ref(input_ids=ids).logits
                ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
            out[i, name] = ids[0, len(prompt) :].tolist()
    return out


def test_mixed_batch_matches_peft_and_is_isolated(adapter_dirs):
    from minillm import LLM, SamplingParams

    names = ["a0", "a1", "a2"]
    loras = {
        n: LoRARequest(n, i + 1, str(adapter_dirs / n)) for i, n in enumerate(names)
    }
    llm = LLM(
        device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=6
    )
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ["The for statement", "A dict", "If x is"]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    mixed = [(i, n) for i in range(len(prompts)) for n in [None, *names]]
    outs = llm.generate([prompts[i] for i, _ in mixed], params, use_tqdm=False,
                        lora_request=[n and loras[n] for _, n in mixed])  # fmt: skip
    ours = {key: o.outputs[0].token_ids for key, o in zip(mixed, outs)}
    assert ours == _peft_greedy(adapter_dirs, names, prompts, 8)
    for i, n in [(0, "a1"), (2, None), (1, "a2")]:  # alone, same tokens
        alone = llm.generate(prompts[i], params, lora_request=n and loras[n],
                             use_tqdm=False)  # fmt: skip
        assert alone[0].outputs[0].token_ids == ours[i, n]


def test_scheduler_runs_at_most_max_loras_adapters_per_step(adapter_dirs):
    from minillm import LLM, SamplingParams

    llm = LLM(device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8)
    engine = llm.llm_engine
    loras = [LoRARequest(f"a{i}", i + 1, str(adapter_dirs / f"a{i}")) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(6):
        engine.add_request(str(i), [5, 6, 7], params, lora_request=loras[i % 3])
    seen = set()
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule()
        ids = {r.lora_request.lora_int_id for r in out.scheduled_requests}
        assert len(ids) <= 1
        seen |= ids
        if out.scheduled_requests:
            result = engine.model_runner.execute_model(out)
            updated = engine.scheduler.update_from_output(out, result.sampled_token_ids)
            engine.process_outputs(updated, result)
    assert seen == {1, 2, 3}


def test_bad_lora_request_changes_nothing(adapter_dirs, tmp_path):
    from minillm import LLM, SamplingParams

    llm = LLM(device="cpu", enable_lora=True, max_loras=1, max_lora_rank=4)
    manager = llm.llm_engine.model_runner.lora_manager
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    good = LoRARequest("a1", 1, str(adapter_dirs / "a1"))  # rank 4
    first = llm.generate([5, 6, 7], params, lora_request=good, use_tqdm=False)

    def state():
        return dict(manager.known), list(manager.cpu), dict(manager.slots)

    before = state()
    shutil.copytree(adapter_dirs / "a1", tmp_path / "mismatched")
    _reshape_one(tmp_path / "mismatched")
    for folder, words in [
        (adapter_dirs / "nope", "adapter_config.json"),
        (adapter_dirs / "a0", "max_lora_rank=4"),  # rank 8
        (tmp_path / "mismatched", "has shape"),
    ]:
        with pytest.raises(LoRAError, match=words):
            llm.generate("The", params, lora_request=LoRARequest("x", 9, str(folder)))
        assert not llm.llm_engine.has_unfinished_requests() and state() == before
    again = llm.generate([5, 6, 7], params, lora_request=good, use_tqdm=False)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    plain = LLM(
        device="cpu",
    )
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate("The", lora_request=LoRARequest("a0", 1, str(adapter_dirs)))


def test_server_serves_adapters_by_name_and_survives_a_bad_one(adapter_dirs, tmp_path):
    try:
        import httpx
    except ImportError:
        import httpx2 as httpx

    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine
    from minillm.lora.serving import LoRAServerExtension
    from minillm.server import ServerThread, create_app, parse_args
    from minillm.tiny import tiny_model

    args = parse_args(
        ["--enable-lora", "--max-lora-rank", "8", "--allow-runtime-lora-updating"]
        + ["--lora-modules", f"a0={adapter_dirs / 'a0'}"]
    )
    config = EngineConfig(num_kv_blocks=64, **LoRAServerExtension.engine_options(args))
    app = create_app(LLMEngine(*tiny_model(progress=False), config), "tiny")
    LoRAServerExtension.extend_app(app, args)

    def complete(client, model):
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 0}
        body["temperature"] = 0
        return client.post("/v1/completions", json=body)

    with ServerThread(app) as server, httpx.Client(base_url=server.url) as c:
        cards = {m["id"]: m["parent"] for m in c.get("/v1/models").json()["data"]}
        assert cards == {"tiny": None, "a0": "tiny"}
        base, adapted = complete(c, "tiny").json(), complete(c, "a0").json()
        # the adapter changes every layer: the chosen tokens' logprobs differ
        lps = [r["choices"][0]["logprobs"]["token_logprobs"] for r in (base, adapted)]
        assert lps[0] != lps[1]
        bad = {"lora_name": "bad", "lora_path": str(adapter_dirs)}
        assert c.post("/v1/load_lora_adapter", json=bad).status_code == 400
        shutil.copytree(adapter_dirs / "a0", tmp_path / "mismatched")
        _reshape_one(tmp_path / "mismatched")
        bad["lora_path"] = str(tmp_path / "mismatched")  # read in full at load
        assert c.post("/v1/load_lora_adapter", json=bad).status_code == 400
        assert {m["id"] for m in c.get("/v1/models").json()["data"]} == set(cards)
        good = {"lora_name": "a1", "lora_path": str(adapter_dirs / "a1")}
        assert c.post("/v1/load_lora_adapter", json=good).status_code == 200
        assert complete(c, "a1").status_code == 200
        again = complete(c, "a0").json()["choices"]
        assert again == adapted["choices"]  # still serving, the same tokens
        metrics = c.get("/metrics").text  # vLLM's lora_requests_info, our prefix
        assert 'minillm:lora_requests_info{max_lora="1"' in metrics
        gone = {"lora_name": "a1"}
        assert c.post("/v1/unload_lora_adapter", json=gone).status_code == 200
        assert complete(c, "a1").status_code == 404
    args.lora_modules = [str(adapter_dirs / "a0")]  # no NAME=
    with pytest.raises(SystemExit, match="NAME=PATH"):
        LoRAServerExtension.extend_app(create_app(LLMEngine(*tiny_model()), "t"), args)


def test_persistent_batch_and_async_scheduling_give_the_same_tokens(adapter_dirs):
    from minillm import LLM, SamplingParams

    loras = [LoRARequest(f"a{i}", i + 1, str(adapter_dirs / f"a{i}")) for i in range(3)]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [5, 6]] * 2
    lrs = [None, *loras, *loras, None]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = []
    for runner in [
        dict(persistent_batch=False),
        dict(persistent_batch=True),
        dict(persistent_batch=True, async_scheduling=True),
    ]:
        llm = LLM(
            device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8, **runner
        )
        outs = llm.generate(prompts, params, lora_request=lrs, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[1] == runs[0] and runs[2] == runs[0]


def test_prefix_cache_keys_on_the_adapter_name_and_path(adapter_dirs):
    from minillm import LLM, SamplingParams

    llm = LLM(
        device="cpu",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        prefix_cache_impl="hash",
    )
    kv, prompt = llm.llm_engine.kv_cache_manager, list(range(5, 45))  # 2 full blocks
    params = SamplingParams(temperature=0, max_tokens=1)

    def hits(lora):
        before = kv.prefix_cache_hits
        llm.generate([prompt], params, lora_request=lora, use_tqdm=False)
        return kv.prefix_cache_hits - before

    a0 = LoRARequest("a", 1, str(adapter_dirs / "a0"))
    assert hits(a0) == 0 and hits(a0) == 32  # the same request twice: shared
    assert hits(LoRARequest("a", 2, str(adapter_dirs / "a2"))) == 0  # other weights
    assert hits(None) == 0  # the base model never meets an adapter's blocks


def test_lora_keeps_the_whole_fast_path():
    from minillm.config import EngineConfig
    from minillm.gpu_model_runner import GPUModelRunner

    def resolve(**options):
        parts = dict(device="cuda", attention_backend="triton", persistent_batch=True)
        return GPUModelRunner.fast_path(EngineConfig(**options), parts), parts

    assert resolve()[0] == (True, True, True)  # no adapters: chapter 16's defaults
    flags, parts = resolve(enable_lora=True)
    assert flags == (True, True, True) and "fast_path_blocked" not in parts
    for options in (dict(torch_compile=False), dict(cuda_graphs=False)):
        assert resolve(enable_lora=True, **options)[0] == resolve(**options)[0]


def test_adapters_survive_chapter_15s_surgery_and_compilation(adapter_dirs):
    """merge_projections, then the wrapping, then fuse_layers and torch.compile, as
    the runner orders them: the same logits as the plain model with the adapter. With
    Dynamo's graphs run as they are (counted): the adapters inside each layer's graph,
    not breaking it; with aot_eager: add_lora's in-place schema through the
    functionalization that Inductor's graphs go through on a GPU."""
    from minillm.fused_layers import fuse_layers
    from minillm.lora.manager import LoRAModelManager
    from minillm.merged_projections import merge_projections
    from minillm.tiny import tiny_model

    graph_calls = []

    def counting(gm, example_inputs):  # Dynamo's eager backend, counting the calls
        def run(*args):
            graph_calls.append(gm)
            return gm.forward(*args)

        return run

    lr = LoRARequest("a0", 1, str(adapter_dirs / "a0"))
    logits = {}
    for backend in (None, counting, "aot_eager"):
        model, _ = tiny_model(progress=False)
        if backend:
            merge_projections(model)
        manager = LoRAModelManager(model, 2, 8, 2)
        if backend:
            assert fuse_layers(model)  # the fused layers keep the wrapped ones
            for layer in model.model.layers:
                layer.compile(backend=backend, dynamic=True)
        manager.add_adapter(lr)
        for n in (6, 9):  # two steps of different lengths: one graph serves both
            ids, positions = torch.arange(5, 5 + 2 * n), torch.arange(n).repeat(2)
            manager.set_batch([lr, None], [n, n])  # request 0 adapted, 1 the base
            graph_calls.clear()
            with torch.no_grad():
                logits[backend, n] = model(ids[None], positions[None])
            manager.clear_batch()
            if backend is counting:  # one graph a layer, add_lora in it four times
                assert len(graph_calls) == len(model.model.layers)
                ops = [str(node.target) for node in graph_calls[0].graph.nodes]
                assert sum("add_lora" in op for op in ops) == 4, ops
            if backend:
                torch.testing.assert_close(logits[backend, n], logits[None, n],
                                           rtol=1e-5, atol=1e-5)  # fmt: skip


def test_live_adapters_stay_cached_and_cannot_be_removed(adapter_dirs, tmp_path):
    from minillm import LLM, SamplingParams

    llm = LLM(
        device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1
    )
    engine, params = llm.llm_engine, SamplingParams(max_tokens=2, ignore_eos=True)
    manager = engine.model_runner.lora_manager
    for i in range(3):  # three adapters live at once, one CPU place: all pinned
        shutil.copytree(adapter_dirs / f"a{i}", tmp_path / f"a{i}")
        lora = LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}"))
        engine.add_request(str(i), [5, 6, 7], params, lora_request=lora)
    assert sorted(manager.cpu) == [1, 2, 3]
    with pytest.raises(LoRAError, match="live requests"):
        manager.remove_adapter(2)
    for i in range(3):  # the folders go: the pinned copies still serve
        shutil.rmtree(tmp_path / f"a{i}")
    while engine.has_unfinished_requests():
        engine.step()
    assert len(manager.cpu) == 3 and manager.remove_adapter(2)  # idle: removable
    manager.cpu.pop(1)  # evicted; its folder is gone, so a slot load fails...
    assert manager.activate([3]) == {3: 0}  # the one slot is taken
    with pytest.raises(LoRAError):
        manager.activate([1])
    assert dict(manager.slots) == {3: 0}  # ...and the slot's adapter stays


def test_merged_qkv_and_gate_up_layers_take_the_same_adapter(adapter_dirs):
    from minillm.lora.manager import LoRAModelManager
    from minillm.merged_projections import merge_projections
    from minillm.tiny import tiny_model

    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    positions = torch.arange(ids.shape[1])[None]
    logits = {}
    for merged in (False, True):
        model, _ = tiny_model(progress=False)
        if merged:
            merge_projections(model)  # chapter 15's surgery, before the wrapping
        manager = LoRAModelManager(model, 2, 8, 2)
        widths = {len(layer.slices) for layer, _ in manager.targets.values()}
        assert widths == ({1, 2, 3} if merged else {1})  # qkv: 3 slices, gate_up: 2
        for lr in (None, LoRARequest("a0", 1, str(adapter_dirs / "a0"))):
            if lr is not None:
                manager.add_adapter(lr)
            manager.set_batch([lr], [ids.shape[1]])
            with torch.no_grad():
                logits[merged, lr is None] = model(ids, positions)
            manager.clear_batch()
    torch.testing.assert_close(logits[True, False], logits[False, False])
    torch.testing.assert_close(logits[True, True], logits[False, True])
    assert not torch.allclose(logits[False, False], logits[False, True])


def test_enable_lora_builds_with_the_devices_defaults(adapter_dirs, device, fast_path):
    from minillm import LLM, SamplingParams

    llm = LLM(device=device, enable_lora=True, max_lora_rank=8)  # no runner options
    lora = LoRARequest("a0", 1, str(adapter_dirs / "a0"))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([5, 6, 7], params, lora_request=lora, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    flags = fast_path(llm.llm_engine)
    if device == "cuda":  # chapter 16's defaults: graphs, compiled layers, async
        assert flags["cuda_graphs"] and flags["torch_compile"]
        assert flags["async_scheduling"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_replay_the_adapters_kernels(adapter_dirs):
    from minillm import LLM, SamplingParams

    loras = [LoRARequest(f"a{i}", i + 1, str(adapter_dirs / f"a{i}")) for i in range(3)]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [5, 6], [7, 8, 9]] * 3
    lrs = [None, *loras, None] * 3
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs, graph_steps, slot_loads = [], [], []
    # eager; graphs; graphs over chapter 15's compiled layers. Two slots for three
    # adapters: reloads mid-run
    for graphs, compiled in ((False, False), (True, False), (True, True)):
        llm = LLM(device="cuda", dtype="float32", enable_lora=True, max_loras=2,
                  max_lora_rank=8, cuda_graphs=graphs, torch_compile=compiled,
                  gpu_memory_utilization=0.3)  # fmt: skip
        outs = llm.generate(prompts, params, lora_request=lrs, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
        runner = llm.llm_engine.model_runner
        graph_steps.append(runner.num_graph_steps)
        slot_loads.append(runner.lora_manager.num_slot_loads)
        llm.shutdown()
    assert graph_steps[0] == 0 < graph_steps[1] and slot_loads[1] >= 3  # one evicted
    assert runs[1] == runs[0] and runs[2] == runs[0]
