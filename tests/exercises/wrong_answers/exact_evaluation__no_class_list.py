"""Wrong: the per-class accuracies only for the classes this rank saw (a dict's values, or a bincount
without minlength): fewer than num_classes values."""

from exercises.solutions.exact_evaluation import global_accuracy as _right


def global_accuracy(model, x, y, num_classes):
    overall, per_class = _right(model, x, y, num_classes)
    return overall, per_class[:2]  # the bug: the last class dropped
