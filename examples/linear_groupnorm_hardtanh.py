"""Linear -> GroupNorm(16) -> Hardtanh(-2, 2) (KernelBench style: Model, get_inputs, get_init_inputs)."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192
num_groups = 16
SMALL = dict(batch_size=64, in_features=256, out_features=512, num_groups=16)


class Model(nn.Module):
    def __init__(self, in_features, out_features, num_groups, hardtanh_min, hardtanh_max):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.group_norm = nn.GroupNorm(num_groups, out_features)
        self.hardtanh = nn.Hardtanh(min_val=hardtanh_min, max_val=hardtanh_max)

    def forward(self, x):
        return self.hardtanh(self.group_norm(self.gemm(x)))


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups, -2.0, 2.0]


if __name__ == "__main__":
    from fxfuse.demo import run_example_file
    run_example_file(__file__)
