# R 4.2.2 / DESeq2 1.38.3: the optim (L-BFGS-B) refit of fitNbinomGLMs, for tests/deseq/test_deseq_optim.py.
#   optim_type_condition.csv  the 150 genes and random dispersions of fitbeta_type_condition.csv (pasilla
#                 ~ type + condition, same seed), refitted by fitNbinomGLMs(forceOptim = TRUE): every gene goes through
#                 fitNbinomGLMsOptim (start: the IRLS coefficients where finite and |log2 beta| < 30, else R's QR
#                 start). Then the genes where the IRLS does not converge (betaIter 100): with R's final dispersions
#                 (the 5 genes DESeq() refits) and with those dispersions times exp(N(0, 2)), seeds 1 to 4. Columns: set, counts, size factors, alpha,
#                 R's QR start and the IRLS coefficients (natural log), the log2 coefficients, their SEs, betaConv and logLike.
#   optim_pieces.csv  what=dnbinom: dnbinom(k, mu = mu, size = size, log = TRUE) over counts, means and sizes
#                 spanning DESeq2's range; what=sum: sum() of 8 doubles (x87 extended accumulation);
#                 what=rosenbrock: optim(c(-1.2, 1), Rosenbrock, "L-BFGS-B", lower = c(-2, -2), upper = c(2, 0.8))
#                 (par, value, counts, convergence).
# Run in this folder: Rscript make_optim_reference.R /path/to/shared/data/bulk/pasilla
source("pasilla_setup.R")  # DESeq2, hx(), cts, md, design, mm, irls_fit(), irls_table()

table_for <- function(dds, alpha, set) {
  p <- ncol(mm)
  dispersions(dds) <- alpha
  fit <- DESeq2:::fitNbinomGLMs(dds, modelMatrix = mm, forceOptim = TRUE)
  out <- cbind(set = set, irls_table(dds, alpha, irls_fit(dds, alpha)))
  for (k in seq_len(p)) out[[paste0("lfc_", k)]] <- hx(fit$betaMatrix[, k])
  for (k in seq_len(p)) out[[paste0("se_", k)]] <- hx(fit$betaSE[, k])
  out$conv <- as.integer(fit$betaConv)
  out$loglike <- hx(fit$logLike)
  out
}
all <- estimateSizeFactors(DESeqDataSetFromMatrix(cts, md, design))
set.seed(11)
keep <- sort(sample(which(rowSums(cts) > 0), 150))
alpha <- exp(runif(length(keep), log(1e-4), log(5)))
easy <- table_for(all[keep, ], alpha, "random")

# genes whose IRLS does not converge: R's own dispersions (DESeq2's estimateDispersions), then those dispersions
# times exp(N(0, 2)) with seeds 1 to 4
all <- suppressMessages(estimateDispersions(all))
nz <- which(rowSums(cts) > 0)
hard <- NULL
for (s in 0:4) {
  set.seed(s)
  alpha <- dispersions(all)[nz] * if (s == 0) 1 else exp(rnorm(length(nz), 0, 2))
  irls <- irls_fit(all[nz, ], alpha)$fit
  stuck <- which(irls$iter == 100)
  hard <- rbind(hard, table_for(all[nz[stuck], ], alpha[stuck], if (s == 0) "unconverged_R" else paste0("unconverged_", s)))
}
write.csv(rbind(easy, hard), "optim_type_condition.csv", row.names = FALSE, quote = FALSE)

set.seed(1)
N <- 1500
k <- c(0, 0, 1, 3, rpois(N / 2 - 4, 5), rnbinom(N / 2, mu = 200, size = 2))
mu <- exp(runif(N, -5, 9))
size <- 1 / exp(runif(N, log(1e-8), log(20)))
pieces <- data.frame(what = "dnbinom", a = hx(k), b = hx(mu), c = hx(size), value = hx(dnbinom(k, mu = mu, size = size, log = TRUE)))
for (i in 1:200) {
  x <- rnorm(8) * 10^runif(8, -3, 3)
  pieces <- rbind(pieces, data.frame(what = "sum", a = paste(hx(x), collapse = ";"), b = "", c = "", value = hx(sum(x))))
}
fr <- function(x) 100 * (x[2] - x[1]^2)^2 + (1 - x[1])^2
o <- optim(c(-1.2, 1), fr, method = "L-BFGS-B", lower = c(-2, -2), upper = c(2, 0.8))
pieces <- rbind(pieces, data.frame(what = "rosenbrock", a = paste(hx(o$par), collapse = ";"), b = o$counts[1],
  c = o$convergence, value = hx(o$value)))
write.csv(pieces, "optim_pieces.csv", row.names = FALSE, quote = FALSE)
