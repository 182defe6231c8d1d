"""The anchor's models: how far each proximal anchor sits from the current policy (model), the drift
(drift), the anchor's own effect on clipping (clip_rates), how closely each schedule tracks
recompute (tracking) and the schedule fitted to the logs (fit_schedule)."""
