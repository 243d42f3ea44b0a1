"""roll_ds's Hydra search-path plugin (see ``roll_ds_searchpath.py``)."""
