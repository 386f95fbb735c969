"""The files outcore reads and writes beside its own store: safetensors (a header checked before
use, a stream written tensor by tensor), `torch.save` files read in place, files and folders
written where others may write too, and where an export lands."""
