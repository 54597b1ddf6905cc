"""Trainer: packs training rows into micro-batches, computes the policy loss, updates the
model. It knows no algorithm: advantages and weights arrive written on the rows.

Modules: `config` (settings, torch-free), `loss`, `packing`, `gradients` (one optimizer
step's loss and backward, shared with the benches), `trainer`. Import from them
directly; this package imports nothing so that reading a config stays light.
"""
