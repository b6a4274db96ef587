"""Router training: label a corpus by teacher-forcing a model pair, train a CITER, R2R or Co-LLM
head, calibrate its threshold on held-out sequences, save a router folder (see docs/QUALITY.md)."""

from tokenrouter.training.calibrate import Calibration, auc, calibrate, evaluate
from tokenrouter.training.labels import Features, build_features, read_corpus
from tokenrouter.training.train import TrainedHead, TrainSettings, train_head, train_router

__all__ = ["Calibration", "Features", "TrainSettings", "TrainedHead", "auc", "build_features", "calibrate",
           "evaluate", "read_corpus", "train_head", "train_router"]
