"""Patch time: which models can be sequence-parallel, decided by what their code does. The structure first,
then a dry run on a tiny batch (the full run, the shard runs, the packed runs) whose records prove each part
or name the module that is refused. Reads forward/ (it shards the dry run's batch as a forward does), never
the other way."""
