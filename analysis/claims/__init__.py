"""The claims rule: how a claim is judged (rule), what is shown beside a verdict (beside), the paper's
claims (paper), their tables (tables) and any two-arm contrast through the same rule (contrasts)."""
