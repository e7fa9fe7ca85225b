"""The commands: ``generate`` (``cli``), ``gptgen`` and its subcommands (``gptgen``, ``serve``,
``commands``), batch jobs (``batch``, ``ray_batch``) and attention pictures (``plot``)."""
