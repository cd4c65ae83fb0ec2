"""The direct-launch protocol of ``culmen.ops.common.launch.Launch`` against a fake Triton kernel that
records its calls, so the argument order that the GPU fast path relies on is checked on CPU too."""

from __future__ import annotations

from culmen.ops.common import launch as L


class _Compiled:
    function, packed_metadata = "fn-handle", "packed"

    def __init__(self, log):
        self.log = log

    def launch_metadata(self, grid, stream, *args):
        self.log.append(("metadata", grid, stream, args))
        return "md"

    def run(self, *a):
        self.log.append(("run", *a))


class _Kernel:
    arg_names = ["x_ptr", "n", "BLOCK", "FLAG"]  # two runtime args, then the constexprs

    def __init__(self):
        self.log = []
        self.compiled = _Compiled(self.log)

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append(("triton", grid, args, kw))
            return self.compiled
        return launch


def test_plan_tuning_reports_every_change():
    seen = []
    t = L.PlanTuning({"a": 1}, lambda: seen.append(1))
    t["a"] = 2
    t.update(b=3)
    del t["b"]
    t.clear()
    assert len(seen) == 4 and t == {}


def test_host_integer_helpers():
    assert [L.cdiv(a, 4) for a in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert [L.next_pow2(n) for n in (0, 1, 2, 3, 17, 64)] == [1, 1, 2, 4, 32, 64]


# ------------------------------------------------------------------------------------ Launch


class _Launcher:
    """Stands for Triton 3.6's CudaLauncher: ``launch`` is its C entry point."""

    global_scratch_size = 0
    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = False

    def __init__(self, log):
        self.log = log

    def launch(self, *a):
        self.log.append(("direct", *a))

    def __call__(self, *a):
        self.log.append(("run", *a))


class _Compiled36(_Compiled):
    def __init__(self, log):
        super().__init__(log)
        self.run = _Launcher(log)


def _launch_setup(monkeypatch, version="3.6.0", hooks=(None, None)):
    monkeypatch.setattr(L, "_FAST", True)
    monkeypatch.setattr(L, "_FAKE_RUN", None)
    monkeypatch.setattr(L, "_triton_version", lambda: version)
    monkeypatch.setattr(L, "_launch_hooks", lambda: hooks)
    k = _Kernel()
    k.compiled = _Compiled36(k.log)
    return k, L.Launch(k, (5, 2), {"FLAG": True, "BLOCK": 64}, num_warps=4)


def test_launch_binds_after_first_call_and_launches_directly(monkeypatch):
    k, la = _launch_setup(monkeypatch)
    la(77, True, "X", 7)  # first call: Triton's own dispatch compiles and launches (fma contraction stated)
    assert k.log == [("triton", (5, 2, 1), ("X", 7), {"FLAG": True, "BLOCK": 64, "num_warps": 4, "num_stages": 3,
                                                      "enable_fp_fusion": True})]
    assert la.consts == (64, True)  # constexprs in signature order
    k.log.clear()
    la(78, True, "Y", 9)
    # gx, gy, gz, stream, function, cooperative, pdl, global scratch, profile scratch, packed metadata,
    # launch metadata, enter hook, exit hook, runtime args, constexprs
    assert k.log == [("direct", 5, 2, 1, 78, "fn-handle", False, False, None, None, "packed", None, None, None,
                      "Y", 9, 64, True)]


def test_launch_unknown_triton_version_goes_through_compiled_run(monkeypatch):
    k, la = _launch_setup(monkeypatch, version="9.9.0")
    la(1, True, "X", 7)
    k.log.clear()
    la(2, True, "Y", 9)
    assert k.log == [("run", 5, 2, 1, 2, "fn-handle", "packed", None, None, None, "Y", 9, 64, True)]


def test_launch_misaligned_or_hooked_or_off_takes_tritons_path(monkeypatch):
    k, la = _launch_setup(monkeypatch)
    la(1, False, "X", 7)  # misaligned pointers: nothing bound
    la(1, False, "X", 7)
    assert [e[0] for e in k.log] == ["triton", "triton"] and la._run is None
    k, la = _launch_setup(monkeypatch, hooks=("enter", "leave"))  # a profiler's launch hooks: never bound
    la(1, True, "X", 7)
    la(1, True, "X", 7)
    assert [e[0] for e in k.log] == ["triton", "triton"]
    k, la = _launch_setup(monkeypatch)
    monkeypatch.setattr(L, "_FAST", False)
    la(1, True, "X", 7)
    la(1, True, "X", 7)
    assert [e[0] for e in k.log] == ["triton", "triton"]
    k, la = _launch_setup(monkeypatch)
    la(None, True, "X", 7)  # no stream (CPU, or another device is current): Triton's path
    la(None, True, "X", 7)
    assert [e[0] for e in k.log] == ["triton", "triton"]


def test_launch_with_scratch_memory_keeps_the_python_launcher(monkeypatch):
    k, la = _launch_setup(monkeypatch)
    k.compiled.run.global_scratch_size = 128
    la(1, True, "X", 7)
    k.log.clear()
    la(2, True, "Y", 9)
    assert k.log[0][0] == "run"


def test_launch_rejects_a_plan_whose_constexprs_do_not_match(monkeypatch):
    k, _ = _launch_setup(monkeypatch)
    la = L.Launch(k, (1,), {"BLOCK": 64}, num_warps=4)  # FLAG missing
    la(1, True, "X", 7)
    la(1, True, "X", 7)
    assert la._run is None and "FLAG" in la.error


def test_fake_kernels_record_launches():
    import torch

    from culmen.ops.layer_norm import layer_norm
    from culmen.testing.hostcost import count_calls, fake_kernels

    x = torch.randn(3, 8)
    with fake_kernels() as launched:
        layer_norm(x)
        layer_norm(x)
        n = count_calls(lambda: layer_norm(x))
    assert len(launched) == 3 and launched[0][3] == 0  # grid, then the fake stream
    assert n.python > 0 and n.c > 0 and "layer_norm" in str(n)


def test_launch_states_fp_fusion_unless_given(monkeypatch):
    """Eager launches compile with ``enable_fp_fusion=True`` (Triton 3.10 turns it off by default) unless the
    plan asks otherwise (FusedAdam's exact rounding: ``False``)."""
    k, _ = _launch_setup(monkeypatch)
    L.Launch(k, (1,), {"FLAG": False, "BLOCK": 16}, num_warps=1, options={"enable_fp_fusion": False})(1, True, "Z", 3)
    assert k.log[-1][3]["enable_fp_fusion"] is False
