"""Use cases. The only layer that coordinates subsystems; interfaces call only this."""
