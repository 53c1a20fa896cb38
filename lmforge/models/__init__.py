"""Model families. One family = one folder: args.py (presets), model.py, hf.py (key map)."""
