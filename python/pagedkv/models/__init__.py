"""Model architectures, one file each; registry.py says which serves a checkpoint's model_type
(each module imported only when a checkpoint needs it) and resolves the checkpoint's traits."""
