"""Linear -> GroupNorm(eps=1e-5) -> LeakyReLU(0.01) -> x + x (KernelBench style: Model, get_inputs,
get_init_inputs)."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192
num_groups = 512
SMALL = dict(batch_size=64, in_features=256, out_features=512, num_groups=32)


class Model(nn.Module):
    def __init__(self, in_features, out_features, num_groups, eps=1e-5, negative_slope=0.01):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.gn = nn.GroupNorm(num_groups=num_groups, num_channels=out_features, eps=eps)
        self.leaky_relu = nn.LeakyReLU(negative_slope=negative_slope)

    def forward(self, x):
        x = self.fc(x)
        x = self.gn(x)
        x = self.leaky_relu(x)
        return x + x


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups]


if __name__ == "__main__":
    from fxfuse.demo import run_example_file
    run_example_file(__file__)
