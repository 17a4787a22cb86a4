# R DESeq2 side of benchmarks/bench_rlog.py:
#   Rscript benchmarks/bench_rlog.R counts.csv values_out.csv timing_out.csv
# counts.csv: genes x samples (first column gene id). rlog(blind=TRUE) (size factors, genewise dispersions with
# design ~1, parametric trend, the rlog fit) timed alone: start-up and reading excluded.
suppressMessages(library(DESeq2))
args <- commandArgs(trailingOnly = TRUE)
cts <- as.matrix(read.csv(args[1], row.names = 1, check.names = FALSE))
dds <- DESeqDataSetFromMatrix(cts, data.frame(row.names = colnames(cts), one = rep(1, ncol(cts))), ~1)
cpu <- function() { pt <- proc.time(); pt[["user.self"]] + pt[["sys.self"]] }
t0 <- proc.time()[["elapsed"]]; c0 <- cpu()
rld <- suppressMessages(rlog(dds, blind = TRUE))
t1 <- proc.time()[["elapsed"]]; c1 <- cpu()
write.csv(signif(assay(rld), 10), args[2])
write.csv(data.frame(stage = "rlog", seconds = t1 - t0, cpu_seconds = c1 - c0, betaPriorVar = attr(rld, "betaPriorVar"),
                     version = as.character(packageVersion("DESeq2"))), args[3], row.names = FALSE)
