"""The engine's checkpoint: the record of the model's states it reads (sharded_model.py), its
sharded, checksummed rank files (sharded.py), the folder and which
tag to read (folder.py), any range of a unit's states from whatever world size wrote them
(shards.py), what a save may touch (guard.py), the base's weights files it records (base_files.py),
and whole-model views of the sharded parameters (state_dict.py)."""
