"""ember.data: datasets and a DataLoader that yields minibatches as ember Tensors."""

from ember.data.distributed import DistributedSampler
from ember.data.loader import DataLoader, Dataset, TensorDataset

__all__ = ["DataLoader", "Dataset", "DistributedSampler", "TensorDataset"]
