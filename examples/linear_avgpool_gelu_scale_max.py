"""Linear -> AvgPool1d(4) over the features -> GELU -> * scale -> row max (KernelBench's
Matmul_AvgPool_GELU_Scale_Max: Model, get_inputs, get_init_inputs). The pool folds into the GEMM: fxfuse averages
the weight's rows and the bias in windows of 4 first, so its GEMM is 4 times smaller than the model's."""
import torch
import torch.nn as nn

batch_size = 1024
in_features = 8192
out_features = 8192
pool_kernel_size = 4
scale_factor = 2.0
SMALL = dict(batch_size=64, in_features=256, out_features=512)


class Model(nn.Module):
    def __init__(self, in_features, out_features, pool_kernel_size, scale_factor):
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.avg_pool = nn.AvgPool1d(kernel_size=pool_kernel_size)
        self.gelu = nn.GELU()
        self.scale_factor = scale_factor

    def forward(self, x):
        x = self.matmul(x)
        x = self.avg_pool(x.unsqueeze(1)).squeeze(1)
        x = self.gelu(x)
        x = x * self.scale_factor
        return torch.max(x, dim=1).values


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, pool_kernel_size, scale_factor]


if __name__ == "__main__":
    from fxfuse.demo import run_example_file
    run_example_file(__file__)
