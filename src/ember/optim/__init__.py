"""ember.optim: optimizers whose step computes forward, backward and update as one graph; lr schedules."""

from ember.optim import lr_scheduler
from ember.optim.adam import Adam, AdamW
from ember.optim.optimizer import Optimizer
from ember.optim.sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "lr_scheduler"]
