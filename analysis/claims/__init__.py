"""The claims rule: how a claim is judged (rule), what is shown beside a verdict (beside), the paper's
claims (paper) and their tables (tables). A two-arm contrast through the same rule, as the study
reports show it, is `analysis.studies.contrast`."""
