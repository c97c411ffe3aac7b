"""Token mixers other than attention (convolutions, scans, linear-attention recurrences), proven at patch time
to need the sequence they would lose to the shard, and run so that they compute what they compute unpatched."""
