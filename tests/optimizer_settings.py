"""Settings of every elementwise ``torch.optim`` optimizer for the tests of its update on pieces
(tests/nn/test_optim_pieces.py, tests/actor_rt/test_compile_optimizers.py): each with the options that
take its update's other branches (momentum, amsgrad, weight decay of either kind, maximize, centered)."""

OPTIMIZERS = {
    "SGD": dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": dict(lr=0.05, eps=1e-6, weight_decay=0.01, amsgrad=True),
    "AdamW": dict(lr=0.05, weight_decay=0.1),
    "Adagrad": dict(lr=0.1, lr_decay=0.01),
    "Adadelta": dict(lr=0.5, weight_decay=0.01),
    "Adamax": dict(lr=0.05),
    "ASGD": dict(lr=0.05, t0=1.0),
    "NAdam": dict(lr=0.05, weight_decay=0.01),
    "RAdam": dict(lr=0.05, decoupled_weight_decay=True, weight_decay=0.01),
    "RMSprop": dict(lr=0.01, momentum=0.5, centered=True),
    "Rprop": dict(lr=0.01, maximize=True),
}
FUSED = ("SGD", "Adam", "AdamW", "Adagrad")          # the classes with a fused CPU kernel
#: the optimizers whose update reads each parameter whole (Muon: 2-D parameters only), stepped on the
#: pieces where every parameter is whole on its ranks
WHOLE_OPTIMIZERS = {
    "Muon": dict(lr=0.02, weight_decay=0.01, momentum=0.9),
    "Adafactor": dict(lr=0.02, weight_decay=0.01),
}
