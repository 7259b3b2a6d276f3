"""Linear -> + bias -> Hardtanh -> Mish -> GroupNorm (KernelBench style: Model, get_inputs, get_init_inputs)."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192
num_groups = 256
SMALL = dict(batch_size=64, in_features=256, out_features=512, num_groups=16)


class Model(nn.Module):
    def __init__(self, in_features, out_features, num_groups):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(torch.randn(out_features) * 0.02)
        self.hardtanh = nn.Hardtanh()
        self.mish = nn.Mish()
        self.groupnorm = nn.GroupNorm(num_groups, out_features)

    def forward(self, x):
        x = self.gemm(x)
        x = x + self.bias
        x = self.hardtanh(x)
        x = self.mish(x)
        return self.groupnorm(x)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups]


if __name__ == "__main__":
    from fxfuse.demo import run_example_file
    run_example_file(__file__)
