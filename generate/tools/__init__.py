"""The commands: ``generate`` (``cli``), ``gptgen`` and its subcommands (``gptgen``, ``serve``,
``score_command``, ``attention_command``, ``batch_command``, with ``command_base`` what the last three share
and ``commands`` naming them), batch jobs (``batch``, ``ray_batch``) and attention pictures (``plot``)."""
