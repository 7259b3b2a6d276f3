"""explain(): the readable table (fused regions with their nodes, program and place in the model; near misses
with their reasons), logging under `fxfuse`, and `python -m fxfuse explain` on a KernelBench-style file.
"""
import logging
import pathlib
import subprocess
import sys
import textwrap

import torch
import torch.nn as nn

import fxfuse

REPO = pathlib.Path(__file__).resolve().parent.parent


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(self.act(self.fc(x)))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).to(torch.float64)


def test_explain_lists_each_region_with_its_nodes_program_and_place():
    report = fxfuse.explain(Encoder(), (torch.randn(2, 16),))
    assert [row.location for row in report.fused] == ["layers.0.fc (layers_0_fc)", "layers.1.fc (layers_1_fc)"]
    assert report.fused[0].replaced == ["layers_0_fc", "layers_0_act", "layers_0_norm"]
    assert report.fused[0].program == "gelu(%0,'none');layer_norm(%1,$0,$1,1e-05)"
    text = str(report)
    assert text.splitlines()[0] == "fxfuse: 2 fused region(s), 1 near miss(es)"
    for expected in ("layers.0.fc (layers_0_fc)", "layers_0_fc, layers_0_act, layers_0_norm",
                     "gelu(%0,'none'); layer_norm(%1,$0,$1,1e-05)", "not fused:", "head"):
        assert expected in text, f"{expected!r} not in\n{text}"


def test_explain_gives_the_reason_for_the_near_miss():
    report = fxfuse.explain(Encoder(), (torch.randn(2, 16),))
    reasons = {(miss.location, miss.node): miss.reason for miss in report.near_misses}
    # A region that ends at the next GEMM is no near miss: only `head`, which nothing could join, is one.
    assert reasons == {("head (head)", "to"): "`to` (to) is not an epilogue op"}


def test_explain_does_not_change_the_model():
    model = Encoder()
    before = str(model)
    fxfuse.explain(model, (torch.randn(2, 16),))
    assert str(model) == before and not any(isinstance(m, torch.fx.GraphModule) for m in model.modules())


def test_explain_of_a_model_without_gemm():
    report = fxfuse.explain(nn.Sequential(nn.ReLU(), nn.Tanh()), (torch.randn(2, 3),))
    assert str(report).splitlines()[0] == "fxfuse: 0 fused region(s), 0 near miss(es)"


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Layer()

    def forward(self, x):
        if x.mean() > 10:  # data-dependent control flow
            return x
        return self.block(x)


def test_explain_of_an_untraceable_model_names_the_child_paths():
    report = fxfuse.explain(Untraceable(), (torch.randn(2, 16),))
    assert [row.location for row in report.fused] == ["block.fc (fc)"]
    assert report.skipped and report.skipped[0].location == "<model>"
    assert "left in eager (could not be traced):" in str(report)


def test_debug_logging_shows_every_match_attempt(caplog):
    with caplog.at_level(logging.DEBUG, logger="fxfuse"):
        fxfuse.optimize(Encoder(), (torch.randn(2, 16),))
    messages = [r.getMessage() for r in caplog.records if r.name == "fxfuse"]
    assert any("anchor layers_0_fc: admitted layers_0_act" in m for m in messages), messages
    assert any("anchor head" in m and "not admitted" in m for m in messages), messages


def test_info_logging_tells_what_was_fused(caplog):
    with caplog.at_level(logging.INFO, logger="fxfuse"):
        fxfuse.optimize(Encoder(), (torch.randn(2, 16),))
    assert any(r.getMessage().startswith("fused layers_0_fc") for r in caplog.records), caplog.text


def test_command_line_explains_a_model_file(tmp_path):
    model_file = tmp_path / "my_model.py"
    model_file.write_text(textwrap.dedent("""
        import torch
        import torch.nn as nn

        class Model(nn.Module):
            def __init__(self, features, groups):
                super().__init__()
                self.gemm = nn.Linear(features, features)
                self.norm = nn.GroupNorm(groups, features)

            def forward(self, x):
                return torch.relu(self.norm(self.gemm(x)))

        def get_inputs():
            return [torch.rand(4, 1000)]

        def get_init_inputs():
            return [1000, 8]
    """))
    result = subprocess.run([sys.executable, "-m", "fxfuse", "explain", str(model_file)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "fxfuse: 1 fused region(s)" in result.stdout
    assert "group_norm(%0,$0,$1,8,1e-05); relu(%1)" in result.stdout, result.stdout
