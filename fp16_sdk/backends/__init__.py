"""Backends: where a training job runs. See base.py for the interface."""
