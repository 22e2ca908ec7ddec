"""Starting, guarding and ending a run: the torchrun wrapper, the preflight check the launch scripts run,
the launcher-death guard and the one-line failure reports."""
