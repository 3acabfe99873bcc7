"""Which ONNX ops torch's exporters emit for the torch functions behind ops without gradient
rules (issue 38 item 1): one row per function, TorchScript (opset 17) | dynamo (opset 18).

Run: python benchmarks/torch_op_survey.py [function name ...]
Results: benchmarks/results/2026-11-29-op-coverage.md."""
from __future__ import annotations

import contextlib
import io
import sys
import warnings

import onnx
import torch
import torch.nn.functional as F

# shape and elementwise plumbing, left out of the rows
PLUMBING = {"Constant", "Shape", "Gather", "Unsqueeze", "Squeeze", "Reshape", "Concat", "Cast", "Identity",
            "ConstantOfShape", "Slice", "Expand", "Range", "Equal", "Where", "Transpose", "Add", "Sub", "Mul",
            "Div"}


class _Fn(torch.nn.Module):
    def __init__(self, f) -> None:
        super().__init__()
        self.f = f

    def forward(self, *a):
        return self.f(*a)


def cases() -> dict:
    torch.manual_seed(0)
    x4, x2 = torch.randn(1, 2, 4, 4), torch.randn(3, 4)
    out = {
        "F.grid_sample": (lambda x, g: F.grid_sample(x, g, align_corners=False), (x4, torch.rand(1, 3, 3, 2) * 2 - 1)),
        "F.affine_grid": (lambda t: F.affine_grid(t, [1, 2, 4, 4], align_corners=False), (torch.randn(1, 2, 3),)),
        "torch.prod(dim)": (lambda x: torch.prod(x, 1), (x2,)),
        "torch.prod(all)": (lambda x: torch.prod(x), (x2,)),
        "torch.var": (lambda x: torch.var(x, 1), (x2,)),
        "torch.cumprod": (lambda x: torch.cumprod(x, 1), (x2,)),
        "torch.linalg.det": (lambda x: torch.linalg.det(x), (torch.randn(2, 3, 3),)),
        "torch.fmod": (lambda x, y: torch.fmod(x, y), (x2, torch.rand(3, 4) + 0.5)),
        "torch.remainder": (lambda x, y: torch.remainder(x, y), (x2, torch.rand(3, 4) + 0.5)),
        "F.fold": (lambda x: F.fold(x, (4, 4), 2, stride=2), (torch.randn(1, 8, 4),)),
        "F.unfold": (lambda x: F.unfold(x, 2, stride=2), (x4,)),
        "F.max_unpool2d": (lambda x: F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2), (x4,)),
        "F.normalize": (lambda x: F.normalize(x, dim=1), (x2,)),
        "F.lp_pool2d": (lambda x: F.lp_pool2d(x, 2, 2), (x4,)),
        "F.local_response_norm": (lambda x: F.local_response_norm(x, 3), (x4,)),
        "F.softshrink": (lambda x: F.softshrink(x, 0.5), (x2,)),
        "F.hardshrink": (lambda x: F.hardshrink(x, 0.5), (x2,)),
        "torch.logsumexp": (lambda x: torch.logsumexp(x, 1), (x2,)),
        "torch.stft": (lambda x: torch.stft(x, 8, return_complex=False, window=torch.ones(8)), (torch.randn(1, 32),)),
        "torch.fft.rfft": (lambda x: torch.view_as_real(torch.fft.rfft(x)), (torch.randn(2, 8),)),
        "torch.flip": (lambda x: torch.flip(x, [1]), (x2,)),
        "torch.trace": (lambda x: torch.trace(x), (torch.randn(3, 3),)),
    }
    try:
        import torchvision

        out["torchvision.ops.roi_align"] = (lambda x, b: torchvision.ops.roi_align(x, b, (2, 2), 1.0, 2),
                                            (x4, torch.tensor([[0, 0.5, 0.5, 3.0, 3.0]])))
        out["torchvision.ops.deform_conv2d"] = (lambda x, o, w: torchvision.ops.deform_conv2d(x, o, w),
                                                (x4, torch.randn(1, 18, 2, 2), torch.randn(3, 2, 3, 3)))
    except ImportError:
        pass
    return out


def op_types(model: onnx.ModelProto) -> set[str]:
    """Op types of the graph, its subgraphs and its local functions."""
    found: set[str] = set()

    def walk(nodes) -> None:
        for n in nodes:
            found.add(n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}")
            for a in n.attribute:
                if a.g is not None:
                    walk(a.g.node)
                for sg in a.graphs:
                    walk(sg.node)

    walk(model.graph.node)
    for f in model.functions:
        walk(f.node)
    return found


def export(f, args, dynamo: bool) -> onnx.ModelProto:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if dynamo:
            return torch.onnx.export(_Fn(f), args, dynamo=True, verbose=False).model_proto
        buf = io.BytesIO()
        torch.onnx.export(_Fn(f), args, buf, dynamo=False, opset_version=17)
        return onnx.load_from_string(buf.getvalue())


def main(only: list[str]) -> None:
    warnings.filterwarnings("ignore")
    for name, (f, args) in cases().items():
        if only and name not in only:
            continue
        row = [name]
        for dynamo in (False, True):
            try:
                ops = op_types(export(f, args, dynamo))
                main_ops = sorted(ops - PLUMBING)
                row.append(" ".join(main_ops) if main_ops else "(plumbing: " + " ".join(sorted(ops)) + ")")
            except Exception as e:  # an export failure is a finding, reported in its row
                row.append("export fails: " + (str(e).splitlines() or [type(e).__name__])[0][:90])
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
