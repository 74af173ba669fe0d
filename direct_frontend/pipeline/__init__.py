"""The per-request pipeline between the HTTP layer and the engines: output postprocessing."""
