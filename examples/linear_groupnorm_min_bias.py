"""Linear -> GroupNorm -> row min (keepdim) -> + bias of shape (1, N, 1, 1), which broadcasts the output to
(1, N, batch, 1) exactly as eager does (KernelBench style: Model, get_inputs, get_init_inputs)."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192
num_groups = 512
SMALL = dict(batch_size=64, in_features=256, out_features=512, num_groups=32)


class Model(nn.Module):
    def __init__(self, in_features, out_features, num_groups, bias_shape):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.group_norm = nn.GroupNorm(num_groups, out_features)
        self.bias = nn.Parameter(torch.randn(bias_shape) * 0.02)

    def forward(self, x):
        x = self.gemm(x)
        x = self.group_norm(x)
        x = torch.min(x, dim=1, keepdim=True)[0]
        return x + self.bias


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups, (1, out_features, 1, 1)]


if __name__ == "__main__":
    from fxfuse.demo import run_example_file
    run_example_file(__file__)
