"""Gathering each rank's records under `torch.distributed`: the gathers and their wire format."""
